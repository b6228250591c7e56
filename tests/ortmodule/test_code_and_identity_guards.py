"""Code and identities a forward runs or compares, replaced between steps (wave 32).

Until wave 32 each case below kept training on the graph of the code it was captured with, with
no new capture and no message: a function on an object the model holds (``self.helper.act``),
in a module's dict or list of functions, a module-level or class-level builtin, an enum member
on a held object, or a nested held object swapped for another of equal read values.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _parity import assert_same_state, capture_reasons_across
from torch import nn

from ortrain import ORTModule

ACTIVATION = torch.tanh  # module-level, builtin: replaced by a test below


def _triple(t: torch.Tensor) -> torch.Tensor:
    return t * 3


class _Helper:
    def __init__(self) -> None:
        self.act: Any = torch.tanh
        self.scale = 1.0


class _Tanh:
    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t)


class _Sigmoid:
    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(t)


class _Holder:
    def __init__(self) -> None:
        self.impl: Any = _Tanh()


class _Mode(enum.Enum):
    SMOOTH = 1
    GATED = 2


class _Settings:
    def __init__(self) -> None:
        self.mode = _Mode.SMOOTH


@dataclasses.dataclass
class _Config:
    act: Any = torch.tanh


class _Net(nn.Module):
    ACT: Any = staticmethod(torch.tanh)

    def __init__(self, forward: Callable[[_Net, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.helper = _Helper()
        self.holder = _Holder()
        self.settings = _Settings()
        self.config = _Config()
        self.table: dict[str, Any] = {"act": torch.tanh}
        self.acts: list[Any] = [torch.tanh, torch.sigmoid]
        self._forward = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(self, self.fc(x)).square().mean()


def _train(
    forward: Callable[[_Net, torch.Tensor], torch.Tensor],
    change: Callable[[_Net], None],
    caplog: pytest.LogCaptureFixture,
    *,
    steps: int = 4,
    at: int | None = 2,
    setup: Callable[[_Net], None] | None = None,
) -> list[str]:
    """Train an ORTModule and an eager copy (of the model after ``setup``), applying ``change``
    to both before step ``at`` (None: before every step); returns why each capture happened."""
    torch.manual_seed(0)
    model = _Net(forward)
    if setup is not None:
        setup(model)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(steps):
            if at is None or step == at:
                change(wrapped.module)
                change(eager)
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            losses = []
            for m in (wrapped, eager):
                loss = m(x)
                loss.backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
                losses.append(loss.item())
            assert losses[0] == pytest.approx(losses[1], rel=1e-5), f"step {step}"
    assert_same_state(wrapped, eager, atol=1e-5)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]


@pytest.mark.parametrize(
    "new",
    [torch.sigmoid, lambda t: t * 3, _triple, functools.partial(torch.mul, other=3.0)],
    ids=["builtin", "lambda", "function", "partial"],
)
def test_a_function_on_a_held_object(new: Any, caplog: pytest.LogCaptureFixture) -> None:
    def setter(m: _Net) -> None:
        m.helper.act = new

    reasons = _train(lambda m, h: m.helper.act(h) * m.helper.scale, setter, caplog)
    assert reasons[1:] == [
        "capturing a graph: helper.act was replaced (the forward runs other code) "
        "(an object held by '(the model)')"
    ]


def test_a_method_rebound_at_every_step_captures_once(caplog: pytest.LogCaptureFixture) -> None:
    """``self.helper.act = self.holder.impl.apply`` makes a new bound method each time: the same
    function on the same object is the same code."""

    def rebind(m: _Net) -> None:
        m.helper.act = m.holder.impl.apply

    assert len(_train(lambda m, h: m.helper.act(h), rebind, caplog, steps=5, at=None)) == 1


def test_a_nested_object_of_another_class(caplog: pytest.LogCaptureFixture) -> None:
    """Both read nothing but ``apply``, which their classes hold: the class is what differs."""

    def swap(m: _Net) -> None:
        m.holder.impl = _Sigmoid()

    reasons = _train(lambda m, h: m.holder.impl.apply(h), swap, caplog)
    assert reasons[1:] == ["capturing a graph: holder.impl was replaced (an object held by '(the model)')"]


def test_an_enum_member_compared_by_identity(caplog: pytest.LogCaptureFixture) -> None:
    def forward(m: _Net, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) if m.settings.mode is _Mode.SMOOTH else torch.sigmoid(h)

    def gate(m: _Net) -> None:
        m.settings.mode = _Mode.GATED

    def back(m: _Net) -> None:
        m.settings.mode = _Mode.SMOOTH if m.settings.mode is _Mode.GATED else _Mode.GATED

    reasons = _train(forward, gate, caplog)
    assert reasons[1:] == [
        "capturing a graph: settings.mode changed from <_Mode.SMOOTH: 1> to <_Mode.GATED: 2> "
        "(an object held by '(the model)')"
    ]
    # Back and forth: each member finds its own graph again (until wave 32 the second member's
    # graph was found under the first's key: the two read the same attributes, none).
    caplog.clear()
    assert len(_train(forward, back, caplog, steps=6, at=1)) == 2


def test_a_function_in_a_dataclass_config(caplog: pytest.LogCaptureFixture) -> None:
    """Replacing it raised TypeError in the message that says why (wave 31)."""

    def setter(m: _Net) -> None:
        m.config.act = _triple

    reasons = _train(lambda m, h: m.config.act(h), setter, caplog)
    assert reasons[1:] == [
        "capturing a graph: config.act was replaced (the forward runs other code) "
        "(a config held by '(the model)')"
    ]


def test_an_entry_of_a_modules_dict_of_functions(caplog: pytest.LogCaptureFixture) -> None:
    def setter(m: _Net) -> None:
        m.table["act"] = _triple

    reasons = _train(lambda m, h: m.table["act"](h), setter, caplog)
    assert reasons[1:] == [
        "capturing a graph: table.act was replaced (the forward runs other code) "
        "(a dict held by '(the model)')"
    ]


def test_an_entry_of_a_modules_list_of_functions(caplog: pytest.LogCaptureFixture) -> None:
    def setter(m: _Net) -> None:
        m.acts[0] = _triple

    reasons = _train(lambda m, h: m.acts[0](h), setter, caplog)
    assert reasons[1:] == [
        "capturing a graph: acts.0 was replaced (the forward runs other code) (a list held by '(the model)')"
    ]


class _GlobalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ACTIVATION(self.fc(x)).square().mean()


class _ClassNet(_GlobalNet):
    ACT: Any = staticmethod(torch.tanh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ACT(self.fc(x)).square().mean()


@pytest.mark.parametrize("where", ["module global", "class attribute"])
def test_a_builtin_replaced_at_module_or_class_level(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def replace(*_: nn.Module) -> None:
        if where == "module global":
            monkeypatch.setitem(globals(), "ACTIVATION", torch.sigmoid)
        else:
            monkeypatch.setattr(_ClassNet, "ACT", staticmethod(torch.sigmoid))

    torch.manual_seed(0)
    model = _GlobalNet() if where == "module global" else _ClassNet()
    reasons = capture_reasons_across(model, replace, caplog, calls_after=1)
    changed = f"global {__name__}.ACTIVATION" if where == "module global" else "method _ClassNet.ACT"
    assert reasons[1] == f"capturing a graph: {changed} was replaced (the forward runs other code)"


class _Scaled:
    SCALE = 1.0

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t) * self.SCALE


@dataclasses.dataclass
class _ScaledConfig:
    width: int = 4
    SCALE = 1.0  # on the class, not a field


class _ClassReadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.helper = _Scaled()
        self.config = _ScaledConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.helper.apply(self.fc(x)) * self.config.SCALE).square().mean()


@pytest.mark.parametrize(
    ("owner", "name", "value", "reason"),
    [
        (
            _Scaled,
            "apply",
            lambda self, t: torch.sigmoid(t),
            # Found through the class since wave 45 (``apply`` is also nn.Module's method name).
            "method _Scaled.apply was replaced (the forward runs other code)",
        ),
        (_Scaled, "SCALE", 3.0, "helper.SCALE changed from 1.0 to 3.0"),
        (_ScaledConfig, "SCALE", 3.0, "config.SCALE changed from 1.0 to 3.0"),
    ],
    ids=["held object's method", "held object's class value", "dataclass's class value"],
)
def test_a_value_the_forward_reads_from_a_held_objects_class(
    owner: type,
    name: str,
    value: Any,
    reason: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    reasons = capture_reasons_across(
        _ClassReadNet(), lambda a, b: monkeypatch.setattr(owner, name, value), caplog, calls_after=1
    )
    assert reasons[1].startswith(f"capturing a graph: {reason}")


BASE_WEIGHT = 1.0  # module-level, read by a held object's method and property below


class _Weighted:
    def __init__(self) -> None:
        self.beta = 1.0

    def weight(self) -> float:
        return BASE_WEIGHT * self.beta

    @property
    def shifted(self) -> float:
        return BASE_WEIGHT + self.beta


class _WeightedNet(nn.Module):
    def __init__(self, read: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.weighting = _Weighted()
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = self.weighting.weight() if self.read == "method" else self.weighting.shifted
        return (self.fc(x) * factor).square().mean()


@pytest.mark.parametrize("read", ["method", "property"])
def test_a_global_read_by_a_held_objects_method(
    read: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    reasons = capture_reasons_across(
        _WeightedNet(read),
        lambda a, b: monkeypatch.setitem(globals(), "BASE_WEIGHT", 3.0),
        caplog,
        calls_after=1,
    )
    assert reasons[1] == f"capturing a graph: global {__name__}.BASE_WEIGHT changed from 1.0 to 3.0"


# ---- what a held function computes with besides its code (wave 33) ------------------------------

SCALE = 1.0  # read by _scaled_forward, which the model holds: changed by a test below


def _scaled_forward(m: _Net, h: torch.Tensor) -> torch.Tensor:
    return h * SCALE


def test_a_value_a_held_function_reads_from_its_closure(caplog: pytest.LogCaptureFixture) -> None:
    """A function held by a module (here the model's ``_forward``), made by a factory over a
    settings dict: until wave 33 watched by identity alone, and ``settings["scale"] = 3.0`` kept
    the graph of 1.0."""
    settings = {"scale": 1.0}
    reasons = _train(lambda m, h: h * settings["scale"], lambda m: settings.update(scale=3.0), caplog)
    assert len(reasons) == 2
    assert "settings['scale'] changed from 1.0 to 3.0 (a function held by '(the model)')" in reasons[1]


def test_a_global_a_held_function_reads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def rescale(m: _Net) -> None:
        monkeypatch.setattr(f"{__name__}.SCALE", 3.0)

    reasons = _train(_scaled_forward, rescale, caplog)
    assert reasons[1:] == [
        f"capturing a graph: _forward: global {__name__}.SCALE changed from 1.0 to 3.0 "
        "(a function held by '(the model)')"
    ]


@pytest.mark.parametrize("where", ["held object", "list"])
def test_a_closure_value_of_a_function_in_a_held_object_or_a_list(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = {"scale": 1.0}

    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t * settings["scale"]

    def hold(m: _Net) -> None:
        m.helper.act, m.acts[0] = scaled, scaled

    def forward(m: _Net, h: torch.Tensor) -> torch.Tensor:
        return m.helper.act(h) if where == "held object" else m.acts[0](h)

    reasons = _train(forward, lambda m: settings.update(scale=3.0), caplog, setup=hold)
    assert "settings['scale'] changed from 1.0 to 3.0" in reasons[-1]


class _LeakyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x) - 1).sum()


def test_a_partials_keywords_changed_in_place(caplog: pytest.LogCaptureFixture) -> None:
    def steeper(*models: nn.Module) -> None:
        for m in models:
            m.act.keywords["negative_slope"] = 0.5

    reasons = capture_reasons_across(_LeakyNet(), steeper, caplog)
    assert reasons[1:] == [
        "capturing a graph: act: keyword negative_slope changed from 0.1 to 0.5 "
        "(a function held by '(the model)')"
    ]


def test_a_partial_rebuilt_equal_at_every_step_captures_once(caplog: pytest.LogCaptureFixture) -> None:
    """A partial is what it wraps and binds: until wave 33 one rebuilt at every step (equal) was
    a new object at every step, and each step captured again."""

    def rebuild(m: _Net) -> None:
        m.helper.act = functools.partial(torch.mul, other=3.0)

    assert len(_train(lambda m, h: m.helper.act(h), rebuild, caplog, steps=5, at=None)) == 1


class _Registry:
    """Kept at module level, as Hugging Face keeps its attention functions: its functions are
    compared by identity, not described."""

    def __init__(self) -> None:
        self.fn: Any = functools.partial(torch.mul, other=2.0)


REGISTRY = _Registry()


def test_a_partial_replaced_in_a_module_level_registry(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another partial there is other code (an undescribed partial equal to any other would have
    kept the graph of ``torch.mul``)."""

    def swap(m: _Net) -> None:
        monkeypatch.setattr(REGISTRY, "fn", functools.partial(torch.add, other=2.0))

    reasons = _train(lambda m, h: REGISTRY.fn(h), swap, caplog)
    assert len(reasons) == 2
    assert "REGISTRY" in reasons[1]


def test_a_partial_that_binds_itself_is_described_without_recursing() -> None:
    """A held function's state holds the functions it binds, a few deep at most: a partial in its
    own keywords recursed until Python's limit at the first step."""
    model = _LeakyNet()
    model.act.keywords["self_reference"] = model.act  # held, never called
    model.forward = lambda x: torch.nn.functional.leaky_relu(model.fc(x), 0.1).sum()  # type: ignore[method-assign]
    wrapped = ORTModule(model)
    x = torch.randn(3, 4)
    for _ in range(2):
        wrapped(x).backward()
