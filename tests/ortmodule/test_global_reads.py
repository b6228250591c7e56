"""The module-level values a forward reads (capture/global_reads.py), and the guards seeing them."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import functools
import logging
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.capture.global_reads import code_reads, global_reads

TEMPERATURE = 1.0
SHIFT = 0.0
ACTIVATION = "tanh"
UNUSED = 3.0
settings = types.ModuleType("ortrain_test_settings")  # a config module the script imports
settings.SCALE = 1.0
settings.OTHER = 2.0


@dataclasses.dataclass
class _Schedule:
    warm: bool = True


# A script's configuration objects: a dict that also holds a layer, argparse's namespace, a dataclass.
CONFIG: dict[str, object] = {"scale": 1.0, "activation": nn.Tanh()}
ARGS = argparse.Namespace(shift=0.0)
SCHEDULE = _Schedule()
STATS = {"calls": 0}  # written by a forward


def _shifted(h: torch.Tensor) -> torch.Tensor:
    return h + SHIFT


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._activate(_shifted(self.lin(x) * settings.SCALE))

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) if ACTIVATION == "tanh" else F.relu(h)


class _Annealed(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) / TEMPERATURE).square().mean()


def _capture_reasons_training_beside_eager(
    eager: nn.Module, changes: dict[int, Callable[[], object]], steps: int, caplog: pytest.LogCaptureFixture
) -> list[str]:
    """Train ``eager`` and an ORTModule of its copy side by side, making ``changes[step]`` before
    each step; every step's loss and gradients must be eager's. Returns why each capture happened."""
    wrapped = ORTModule(copy.deepcopy(eager))
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(steps):
            if step in changes:
                changes[step]()
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            expected, got = eager(x), wrapped(x)
            expected.backward()
            got.backward()
            assert got.item() == pytest.approx(expected.item(), rel=1e-6), f"step {step}"
            for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]


def test_reads_follow_helpers_methods_super_and_imported_modules() -> None:
    labels = {label for label, _, _ in global_reads(_Annealed)}
    here = __name__
    assert labels == {
        f"global {here}.TEMPERATURE",  # in forward
        f"global {here}.SHIFT",  # in a helper function of the file
        f"global {here}.ACTIVATION",  # in a method called on self
        "global ortrain_test_settings.SCALE",  # an imported module's attribute, through super()
    }
    assert global_reads(nn.Linear) == ()  # PyTorch's code is not followed


def test_a_changed_global_is_seen(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Wave 23: a module-level temperature annealed by the script stayed at its captured value."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    eager = _Annealed()
    changes = {
        1: lambda: monkeypatch.setattr(f"{__name__}.TEMPERATURE", 0.5),
        2: lambda: monkeypatch.setattr(settings, "SCALE", 2.0),
        3: lambda: monkeypatch.setattr(f"{__name__}.ACTIVATION", "relu"),
        4: lambda: monkeypatch.setattr(f"{__name__}.UNUSED", 4.0),  # read by no forward: no capture
    }
    reasons = _capture_reasons_training_beside_eager(eager, changes, 5, caplog)
    assert len(reasons) == 4, reasons
    assert f"global {__name__}.TEMPERATURE changed from 1.0 to 0.5" in reasons[1]
    assert "global ortrain_test_settings.SCALE changed from 1.0 to 2.0" in reasons[2]
    assert f"global {__name__}.ACTIVATION changed from 'tanh' to 'relu'" in reasons[3]


class _Mode(enum.Enum):
    PLAIN = 1
    NEGATED = 2


class _Consts:
    SCALE = 1.0  # set at start-up from a file, as scripts do
    MODE = _Mode.PLAIN


class _Holder:
    k = 1.0


class _StaticHelpers:
    @staticmethod
    def shift(h: torch.Tensor) -> torch.Tensor:
        return h + _Holder.k


class _ReadsGlobalClasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _StaticHelpers.shift(self.lin(x) * _Consts.SCALE)
        return (-h if _Consts.MODE is _Mode.NEGATED else h).sum()


def test_a_changed_attribute_of_a_global_class_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Until wave 44 a global class was watched by identity alone: ``Consts.SCALE = 3.0`` kept
    the graph of 1.0, and so did a value its static method read of another class."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    changes = {
        1: lambda: monkeypatch.setattr(_Consts, "SCALE", 3.0),
        2: lambda: monkeypatch.setattr(_Holder, "k", -2.0),
        3: lambda: monkeypatch.setattr(_Consts, "MODE", _Mode.NEGATED),  # an enum member (wave 44)
    }
    reasons = _capture_reasons_training_beside_eager(_ReadsGlobalClasses(), changes, 4, caplog)
    assert len(reasons) == 4, reasons
    assert f"class attribute {__name__}._Consts.SCALE changed from 1.0 to 3.0" in reasons[1]
    assert f"class attribute {__name__}._Holder.k changed from 1.0 to -2.0" in reasons[2]


class _Options:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class _ClassProperty:
    """A class-level property: a new object at every read."""

    def __init__(self, getter: Callable[[type], object]) -> None:
        self.getter = getter

    def __get__(self, instance: object, owner: type) -> object:
        return self.getter(owner)


class _Settings:
    options = _ClassProperty(lambda cls: _Options(2.0))


class _ReadsAClassProperty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * _Settings.options.scale).sum()


def test_a_class_level_property_is_read_not_replaced() -> None:
    """Wave 44's first watch of class attributes read them with ``getattr``: the capture's
    snapshot took the object a class-level property returned for a change and "put back" that
    object in its place, on the user's class (eager's numbers too)."""
    descriptor = _Settings.__dict__["options"]
    wrapped = ORTModule(_ReadsAClassProperty())
    for _ in range(2):
        wrapped(torch.randn(3, 4)).backward()
    assert _Settings.__dict__["options"] is descriptor


# A helper module the script imports, whose function reads the module's own setting.
helpers = types.ModuleType("ortrain_test_helpers")
exec("SLOPE = 0.5\n\ndef act(h):\n    return h * SLOPE\n", helpers.__dict__)


class _CallsThroughAModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helpers.act(self.lin(x)).square().mean()


def test_a_helper_called_through_its_module_is_followed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``helpers.act(h)`` reading ``helpers.SLOPE``: until wave 41 a function reached as a module's
    attribute was not walked, and a change to the global it reads kept the old graph (loss -1.656
    where eager gave -0.184); a function replaced on the module was not seen either."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    changes = {
        1: lambda: monkeypatch.setattr(helpers, "SLOPE", 0.9),
        2: lambda: monkeypatch.setattr(helpers, "act", lambda h: h.tanh()),
    }
    reasons = _capture_reasons_training_beside_eager(_CallsThroughAModule(), changes, 3, caplog)
    assert len(reasons) == 3, reasons
    assert "global ortrain_test_helpers.SLOPE changed from 0.5 to 0.9" in reasons[1]
    assert "ortrain_test_helpers.act" in reasons[2]


class _Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * CONFIG["scale"] + ARGS.shift
        h = h.square() if SCHEDULE.warm else h.abs()
        return h.mean()


def test_changed_tables_and_config_objects_are_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 26: ``CONFIG["scale"] = 2.0``, ``args.shift = 0.5`` or ``schedule.warm = False`` between
    steps went unseen (only plain module-level values were watched): the graph kept training on
    the captured values, silently."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    monkeypatch.setitem(CONFIG, "scale", 1.0)
    monkeypatch.setattr(ARGS, "shift", 0.0)
    monkeypatch.setattr(SCHEDULE, "warm", True)
    torch.manual_seed(0)
    eager = _Configured()
    changes = {
        1: lambda: monkeypatch.setitem(CONFIG, "scale", 2.0),
        2: lambda: monkeypatch.setattr(ARGS, "shift", 0.5),
        3: lambda: monkeypatch.setattr(SCHEDULE, "warm", False),
        4: lambda: monkeypatch.setitem(CONFIG, "activation", nn.ReLU()),  # not plain: not read
    }
    reasons = _capture_reasons_training_beside_eager(eager, changes, 5, caplog)
    assert len(reasons) == 4, reasons
    assert f"global {__name__}.CONFIG['scale'] changed from 1.0 to 2.0" in reasons[1]
    assert f"global {__name__}.ARGS.shift changed from 0.0 to 0.5" in reasons[2]
    assert f"global {__name__}.SCHEDULE.warm changed from True to False" in reasons[3]


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        STATS["calls"] += 1
        h = self.lin(x)
        return (h.relu() if STATS["calls"] % 2 else h.sigmoid()).sum()


def test_a_global_the_forward_writes_is_written_once_a_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A forward that counts its calls in a module-level dict: its captures counted three or more
    calls a step (each trace ran the forward) and the captured graph none, so the branch on the
    count stayed as traced. Now a capture puts the dict back and the model trains through
    TorchDynamo's graph breaks, which run the count at every call."""
    torch.manual_seed(0)
    eager = _Counting()
    wrapped = ORTModule(copy.deepcopy(eager))
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(step)) for step in range(4)]
    monkeypatch.setitem(STATS, "calls", 0)
    expected = []
    for x in batches:
        loss = eager(x)
        loss.backward()
        expected.append(loss.item())
    monkeypatch.setitem(STATS, "calls", 0)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for step, x in enumerate(batches):
            loss = wrapped(x)
            loss.backward()
            assert loss.item() == pytest.approx(expected[step], rel=1e-6), f"step {step}"
            assert STATS["calls"] == step + 1
    for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert f"changes the model at every call (global {__name__}.STATS changed)" in caplog.text


def _model_class(scale: float, settings: dict[str, object]) -> type[nn.Module]:
    class Made(nn.Module):  # a class made inside a function reads its closure
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x) * scale * settings["k"]
            return (h.relu() if settings["relu"] else h.tanh()).square().mean()

    return Made


def test_closure_values_are_seen(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Wave 26: a model class defined inside a function read its closure's values once, at capture
    (a settings dict the enclosing code changed between steps went unseen)."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    settings: dict[str, object] = {"k": 1.0, "relu": True}
    made = _model_class(2.0, settings)
    assert {label for label, _, _ in global_reads(made)} == {
        f"closure variable {made.forward.__qualname__}.scale",
        f"closure variable {made.forward.__qualname__}.settings",
    }
    torch.manual_seed(0)
    eager = made()
    changes = {step: functools.partial(settings.update, k=1.0 + step, relu=step != 2) for step in (1, 2)}
    reasons = _capture_reasons_training_beside_eager(eager, changes, 3, caplog)
    assert len(reasons) == 3, reasons
    assert f"closure variable {made.forward.__qualname__}.settings['k'] changed from 1.0 to 2.0" in reasons[1]


def _doubled(h: torch.Tensor) -> torch.Tensor:
    return h * 2


class _Kernel(nn.Module):
    """A module-level callable object, as Hugging Face wraps ``apply_rotary_pos_emb`` for hub kernels."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _shifted(h) * self.scale


rotate = _Kernel(1.0)


class _WithKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(self.lin(x)).square().mean()


def test_code_patched_in_after_a_capture_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 27: patching a class's ``forward`` (``nn.Linear.forward = ...``, as kernel libraries
    patch model classes), a method the forward calls, or a module-level helper after the first step
    left the graph running the old code: losses silently differed from eager's."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    reads = {label for label, _, _ in code_reads(_Annealed)}
    assert {"method _Annealed.forward", "method _Annealed._activate", "method _Base._activate"} <= reads
    assert f"global function {__name__}._shifted" in reads
    assert [label for label, _, _ in code_reads(nn.Linear)] == ["method Linear.forward"]
    torch.manual_seed(0)
    eager = _Annealed()

    def scaled_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * 0.5

    changes = {
        1: lambda: monkeypatch.setattr(nn.Linear, "forward", scaled_linear),
        2: lambda: monkeypatch.setattr(_Base, "_activate", lambda self, h: torch.sigmoid(h)),
        3: lambda: monkeypatch.setattr(f"{__name__}._shifted", _doubled),
        4: lambda: monkeypatch.setattr(_Annealed, "_activate", lambda self, h: F.softplus(h), raising=False),
        5: lambda: None,  # nothing changed: no capture
    }
    reasons = _capture_reasons_training_beside_eager(eager, changes, 6, caplog)
    assert len(reasons) == 5, reasons
    assert "method Linear.forward was replaced" in reasons[1]
    assert "method _Base._activate was replaced" in reasons[2]
    assert f"global function {__name__}._shifted was replaced" in reasons[3]
    assert "method _Annealed._activate was replaced" in reasons[4]  # a subclass given the method


def test_a_callable_object_patched_in_after_a_capture_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 27: Hugging Face's ``apply_rotary_pos_emb`` is an nn.Module instance at module level;
    ``modeling_llama.apply_rotary_pos_emb = faster`` after a capture was not seen."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    reads = {label for label, _, _ in code_reads(_WithKernel)}
    assert f"global function {__name__}.rotate" in reads
    assert f"global function {__name__}._shifted" in reads  # walked through the object's forward
    torch.manual_seed(0)
    changes = {1: lambda: monkeypatch.setattr(f"{__name__}.rotate", _Kernel(0.5))}
    reasons = _capture_reasons_training_beside_eager(_WithKernel(), changes, 3, caplog)
    assert len(reasons) == 2, reasons
    assert f"global function {__name__}.rotate was replaced" in reasons[1]


MARGIN = 0.0  # read only by a method another module calls


class _Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def score(self, h: torch.Tensor) -> torch.Tensor:  # never called by its own forward
        return torch.tanh(self.proj(h)) + MARGIN


class _CallsAnotherModulesMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scorer = _Scorer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer.score(self.lin(x)).square().mean()


def test_a_method_of_another_module_patched_in_after_a_capture_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 28: a forward calling a method of a submodule by name (``self.scorer.score(h)``, a
    head calling its backbone's ``features``) saw neither that method replaced after a capture nor
    a global only that method read: the graph kept the old code and value, silently."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)

    def sigmoid_score(self: _Scorer, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(h)) + MARGIN

    changes = {
        1: lambda: monkeypatch.setattr(_Scorer, "score", sigmoid_score),
        2: lambda: monkeypatch.setattr(f"{__name__}.MARGIN", 0.5),
        3: lambda: None,  # nothing changed: no capture
    }
    reasons = _capture_reasons_training_beside_eager(_CallsAnotherModulesMethod(), changes, 4, caplog)
    assert len(reasons) == 3, reasons
    assert "method _Scorer.score was replaced" in reasons[1]
    assert f"global {__name__}.MARGIN changed from 0.0 to 0.5" in reasons[2]


DEPTH = 1.0  # read only by code patched in after the first capture


def _deeper(self: _Base, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * DEPTH


def _deeper_score(self: _Scorer, h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(self.proj(h)) * DEPTH


@pytest.mark.parametrize(
    ("build", "owner", "method", "patched"),
    [
        (_Annealed, _Base, "_activate", _deeper),  # a method the forward calls on self
        (_CallsAnotherModulesMethod, _Scorer, "score", _deeper_score),  # one another module calls
    ],
)
def test_the_globals_of_code_patched_in_are_watched(
    build: type[nn.Module],
    owner: type,
    method: str,
    patched: Callable[..., torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Wave 28: the walk of a class's code was kept for good; a method patched in after a capture
    was seen, but a global only the new code read was not, and changing it kept the graph."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    changes = {
        1: lambda: monkeypatch.setattr(owner, method, patched),
        2: lambda: monkeypatch.setattr(f"{__name__}.DEPTH", 2.0),
    }
    reasons = _capture_reasons_training_beside_eager(build(), changes, 3, caplog)
    assert len(reasons) == 3, reasons
    assert f"method {owner.__name__}.{method} was replaced" in reasons[1]
    assert f"global {__name__}.DEPTH changed from 1.0 to 2.0" in reasons[2]


lin = 3  # a global named like an attribute the forward reads


class _ReadsAnAttributeNamedLikeAGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_an_attribute_name_is_not_a_global_read() -> None:
    """``self.lin`` put ``lin`` in the code's names: until wave 42 a script's global of that name (a
    loop variable: ``for b in sizes``, ``self.b``) was watched, and each of its values captured again."""
    assert global_reads(_ReadsAnAttributeNamedLikeAGlobal) == ()


class _WithDefaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, temp: float = 1.0, opts: dict = {"scale": 1.0}) -> torch.Tensor:  # noqa: B006
        return (self.lin(x) / temp * opts["scale"]).square().mean()


def test_a_changed_default_argument_of_the_forward_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Until wave 44 the forward's code was watched by identity alone: a changed
    ``forward.__defaults__``, or its default dict changed in place, kept the captured value."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    options = {"scale": 1.0}  # the class's own default dict stays untouched
    monkeypatch.setattr(_WithDefaults.forward, "__defaults__", (1.0, options))
    changes = {
        1: lambda: monkeypatch.setattr(_WithDefaults.forward, "__defaults__", (4.0, options)),
        2: lambda: options.update(scale=3.0),
    }
    reasons = _capture_reasons_training_beside_eager(_WithDefaults(), changes, 3, caplog)
    assert len(reasons) == 3, reasons
    assert "default temp" in reasons[1] and "default opts" in reasons[2]


_KIND = {"k": 3}  # a setting the script keeps in a table
CLIP = float("nan")  # "off"; the script sets it again at every step


class _BranchesOnKind(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        k = _KIND["k"]
        if isinstance(k, bool):
            h = -h
        steps = torch.arange(2 if isinstance(k, bool) else k)  # int64 for 3, float32 for 3.0
        h = h * steps.sum() if steps.is_floating_point() else h + steps.sum()
        return (h if CLIP != CLIP else h.clamp(max=CLIP)).square().mean()


def test_an_equal_value_of_another_kind_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The guards compared plain values with ``==`` until wave 44: ``3`` then ``3.0``, or ``1``
    then ``True``, kept the old graph (its other branch, silently), and a NaN set again at every
    step captured at every step."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    monkeypatch.setitem(_KIND, "k", 3)
    torch.manual_seed(0)
    changes: dict[int, Callable[[], object]] = {
        1: lambda: _KIND.update(k=3.0),
        2: lambda: _KIND.update(k=1),
        3: lambda: _KIND.update(k=True),
    }
    for step in range(4, 6):
        changes[step] = lambda: monkeypatch.setattr(f"{__name__}.CLIP", float("nan"))
    reasons = _capture_reasons_training_beside_eager(_BranchesOnKind(), changes, 6, caplog)
    assert len(reasons) == 4, reasons  # the first call, 3.0, 1 and True; a NaN again: none
    assert "changed from 3 to 3.0" in reasons[1] and "changed from 1 to True" in reasons[3]


_SCHEDULE = {"scale": 1.0}


def _scheduled(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(function)
    def wrapper(self: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        return function(self, *args) * _SCHEDULE["scale"]

    return wrapper


class _ScheduledForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    @_scheduled
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).pow(2).mean()


def test_what_a_wrapping_decorator_reads_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``functools.wraps`` decorator around ``forward`` reading a schedule: only the function it
    wraps was walked, and the graph kept the first scale (wave 45's review: loss 0.087 where
    eager's was 0.173, silently)."""
    assert "_SCHEDULE" in {name for _, _, name in global_reads(_ScheduledForward)}
    torch.manual_seed(0)
    eager = _ScheduledForward()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 8)
    for scale in (1.0, 2.0, 3.0):
        monkeypatch.setitem(_SCHEDULE, "scale", scale)
        torch.testing.assert_close(wrapped(x), eager(x))
