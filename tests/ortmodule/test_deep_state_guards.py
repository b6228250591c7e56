"""State a forward reads more than two objects below a module, changed between steps (wave 36).

Until wave 36 the guards read held objects two levels down and containers two levels deep, and
the capture's snapshot as far: a forward reading ``self.cfg.aug.level.strength`` (plain objects) or
``self.cfg["layers"][0]["scale"]`` trained on, silently, with the value its graph was captured
with after the training loop changed it, and a forward counting on ``self.a.b.c.calls`` counted at
capture only. Now the objects a capture reads through held objects are watched at any depth, and
containers four levels deep.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from _parity import calls_agree, capture_reasons_across
from torch import nn

from ortrain import ORTModule


class _Node:
    """A plain object of the user's: ``_Node(level=_Node(strength=1.0))``."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def _chain(depth: int, leaf: dict[str, Any]) -> _Node:
    node = _Node(**leaf)
    for _ in range(depth - 1):
        node = _Node(inner=node, unread=[1, 2])
    return node


def _leaf(root: Any) -> Any:
    while hasattr(root, "inner"):
        root = root.inner
    return root


class _DeepNet(nn.Module):
    """Reads a value ``depth`` plain objects below the module."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cfg = _chain(depth, {"strength": 1.0})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * _leaf(self.cfg).strength).square().mean()


@pytest.mark.parametrize("depth", [3, 6])
def test_a_value_deep_in_held_objects_changed_between_steps(
    depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    reasons = capture_reasons_across(
        _DeepNet(depth), lambda a, b: [setattr(_leaf(m.cfg), "strength", 3.0) for m in (a, b)], caplog
    )
    assert len(reasons) == 2
    assert "strength changed from 1.0 to 3.0" in reasons[1]


def test_an_object_deep_in_held_objects_replaced(caplog: pytest.LogCaptureFixture) -> None:
    def replace(m: nn.Module) -> None:
        m.cfg.inner.inner = _Node(strength=2.0)

    torch.manual_seed(0)
    reasons = capture_reasons_across(_DeepNet(3), lambda a, b: (replace(a), replace(b)), caplog)
    assert reasons[1:] == ["capturing a graph: cfg.inner.inner changed (an object held by '(the model)')"]


def test_a_self_referencing_object_read_deep_is_watched() -> None:
    """A cycle along the reads (a parent and its child naming each other) ends the walk."""
    torch.manual_seed(0)
    model = _DeepNet(4)
    parent = model.cfg.inner
    parent.inner.parent = parent
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(3, 4)
    assert wrapped(x).item() == pytest.approx(model(x).item(), rel=1e-6)
    for m in (model, wrapped.module):
        _leaf(m.cfg).strength = 2.0
    assert wrapped(x).item() == pytest.approx(model(x).item(), rel=1e-6)


@dataclasses.dataclass
class _Config:
    schedule: _Node
    scale: float = 1.0


class _ConfigHoldsObjectNet(nn.Module):
    """A dataclass config holding a plain object whose value the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cfg = _Config(schedule=_Node(beta=1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.cfg.scale * self.cfg.schedule.beta).square().mean()


def test_an_object_held_by_a_config_changed_between_steps(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    reasons = capture_reasons_across(
        _ConfigHoldsObjectNet(), lambda a, b: [setattr(m.cfg.schedule, "beta", 2.5) for m in (a, b)], caplog
    )
    assert len(reasons) == 2 and "beta changed from 1.0 to 2.5" in reasons[1]


class _NestedContainersNet(nn.Module):
    """Per-layer settings as loaded from YAML: a dict of lists of dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cfg = {"model": {"layers": [{"scale": 1.0}, {"scale": 1.0}]}, "name": "run"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.cfg["model"]["layers"][1]["scale"]).square().mean()


def test_a_value_deep_in_nested_containers_changed_between_steps(caplog: pytest.LogCaptureFixture) -> None:
    def change(m: nn.Module) -> None:
        m.cfg["model"]["layers"][1]["scale"] = 2.0

    torch.manual_seed(0)
    reasons = capture_reasons_across(_NestedContainersNet(), lambda a, b: (change(a), change(b)), caplog)
    assert len(reasons) == 2 and reasons[1].startswith("capturing a graph: cfg")


class _DeepCountNet(nn.Module):
    """A forward that counts its calls on an object three below the module, or in a table three
    containers deep."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.where = where
        self.run = _chain(3, {"calls": 0})
        self.tables = {"a": {"b": {"calls": 0}}}

    def count(self) -> int:
        if self.where == "object":
            counter = _leaf(self.run)
            counter.calls += 1
            return counter.calls
        self.tables["a"]["b"]["calls"] += 1
        return self.tables["a"]["b"]["calls"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.count()).square().mean()


@pytest.mark.parametrize("where", ["object", "table"])
def test_a_forward_that_counts_deep_below_the_module(where: str) -> None:
    """Each call counts once, as eagerly: the capture's trace does not count."""
    calls_agree(_DeepCountNet(where), lambda m: (_leaf(m.run).calls, m.tables["a"]["b"]["calls"]))


class _Temperature:
    def __init__(self) -> None:
        self.t = 1.0

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.t


class _ScaledByABoundMethod(nn.Module):
    def __init__(self, temperature: _Temperature) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = temperature.scale  # the method, not the object

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.fc(x)).logsumexp(-1).mean()


def test_the_object_behind_a_held_bound_method_is_watched() -> None:
    """The loop anneals ``temperature.t``; the model holds only ``temperature.scale``: the graph
    kept t = 1 for good, the loss off by 0.19 at t = 2, silently (wave 50's review)."""
    torch.manual_seed(0)
    temperatures = _Temperature(), _Temperature()
    eager = _ScaledByABoundMethod(temperatures[0])
    wrapped = ORTModule(_ScaledByABoundMethod(temperatures[1]))
    wrapped.load_state_dict(eager.state_dict())
    for t in (1.0, 1.0, 2.0, 4.0):
        x = torch.randn(5, 4)
        for temperature in temperatures:
            temperature.t = t
        losses = [m(x) for m in (eager, wrapped)]
        torch.testing.assert_close(losses[1], losses[0])
