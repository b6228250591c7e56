"""Values a schedule assigns at every step, of types other than Python's, and objects replaced
between steps whose ids come back (wave 36).

Until wave 36 a NumPy scalar, a ``Fraction`` or a ``torch.Size`` on a module was watched by
identity (captured again at every step, even when equal), on a held object or in a config not at
all (the graph kept the first value, silently); and the guards' key held objects' ids, so an
object replaced between steps could be taken for an earlier one whose freed id it reused, and the
earlier one's graph ran.
"""

from __future__ import annotations

import copy
import dataclasses
import fractions
import logging
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _Schedule:
    def __init__(self) -> None:
        self.beta = np.float64(1.0)


@dataclasses.dataclass
class _Config:
    gamma: Any = dataclasses.field(default_factory=lambda: np.float32(1.0))


class _ScheduledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.alpha: Any = np.float32(1.0)
        self.schedule = _Schedule()
        self.cfg = _Config()
        self.shape = torch.Size([3, 4])
        self.device = torch.device("cpu")
        self.consts: Any = types.MappingProxyType({"scale": 1.0})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(self.alpha) * float(self.schedule.beta) * float(self.cfg.gamma) * self.consts["scale"]
        return (self.fc(x.to(self.device)).reshape(self.shape) * scale).square().mean()


def _train(change: Callable[[Any, int], None], caplog: pytest.LogCaptureFixture, steps: int = 6) -> int:
    """Eager and ORTModule agree at every step of ``change``; returns how many captures ran."""
    torch.manual_seed(0)
    model = _ScheduledNet()
    # A MappingProxyType does not deep-copy: the copy takes the model's parameters.
    wrapped = ORTModule(_ScheduledNet())
    wrapped.module.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(steps):
            for m in (model, wrapped.module):
                change(m, step)
            assert wrapped(x).item() == pytest.approx(model(x).item(), rel=1e-6), f"step {step}"
    return sum(r.getMessage().startswith("capturing a graph:") for r in caplog.records)


@pytest.mark.parametrize(
    "change",
    [
        lambda m, step: setattr(m, "alpha", np.float32(1.0 + step)),
        lambda m, step: setattr(m.schedule, "beta", np.linspace(0.5, 3.0, 6)[step]),
        lambda m, step: setattr(m.cfg, "gamma", np.int64(step + 1)),
        lambda m, step: setattr(m, "alpha", fractions.Fraction(step + 1, 3)),
    ],
    ids=["numpy float on the module", "numpy float on a held object", "numpy int in a config", "Fraction"],
)
def test_a_number_of_another_type_changed_at_every_step(
    change: Callable[[Any, int], None], caplog: pytest.LogCaptureFixture
) -> None:
    assert _train(change, caplog) == 6


def test_an_equal_number_size_or_device_assigned_again_captures_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each a new object at every step: until wave 36 each step captured again."""

    def assign(m: Any, step: int) -> None:
        m.alpha = np.float32(2.0)
        m.schedule.beta = np.float64(0.5)
        m.shape = torch.Size([3, 4])
        m.device = torch.device("cpu")

    assert _train(assign, caplog) == 1


def test_a_replaced_object_whose_id_comes_back_is_not_taken_for_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A read-only mapping, watched by identity, replaced at every step: within a few steps a new
    one gets a freed one's id (seen on CPython 3.11)."""

    def replace(m: Any, step: int) -> None:
        m.consts = types.MappingProxyType({"scale": float(step + 1)})

    assert _train(replace, caplog, steps=8) == 8


def test_identity_is_equal_only_for_the_same_live_object() -> None:
    from ortrain.ortmodule.guards import identity_of

    class Thing:
        pass

    a, table = Thing(), {"k": 1}
    assert identity_of(a) == identity_of(a) and identity_of(table) == identity_of(table)
    assert identity_of(a) != identity_of(Thing()) and identity_of(table) != identity_of(copy.copy(table))
    kept = identity_of(a)
    del a
    assert kept != kept  # a dead object equals nothing, itself included


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, temperature: Any, hard: Any = False) -> torch.Tensor:
        h = self.fc(x) / float(temperature)
        return (h.abs() if hard else h.square()).mean()


def test_a_numpy_scalar_or_fraction_argument_is_a_constant(caplog: pytest.LogCaptureFixture) -> None:
    """Each value is a constant of its graph (a new one captures), as a string argument is; until
    wave 36 such an argument sent the model to PyTorch for good (an error under FALLBACK_DISABLE)."""
    torch.manual_seed(0)
    model = _Tempered()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(3, 4)
    calls = [
        (np.float32(0.5), np.bool_(False)),
        (np.float32(0.5), np.bool_(False)),
        (np.int64(2), np.bool_(True)),
        (fractions.Fraction(3, 2), False),
    ]
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for temperature, hard in calls:
            loss, expected = wrapped(x, temperature, hard), model(x, temperature, hard)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
            loss.backward()
            expected.backward()
    for p, q in zip(model.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    captures = [r for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    assert len(captures) == 3
