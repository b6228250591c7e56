"""Models that change while they train: every change is seen (new graph) or refused, never trained wrong.

Each scenario trains an ORTModule and an eager copy through the same changes and compares losses
and parameters after several steps.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import logging
import pickle
import threading
import types
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from _parity import assert_same_state
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule

# Every scenario starts from the same model: its first graphs are exported once (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("shared_export_cache")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.bn(self.fc(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encoder(x)), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


Change = Callable[[nn.Module], None]


def _unwrapped(m: nn.Module) -> nn.Module:
    """The model itself: a change made through the wrapper's setattr drops every graph, and so
    would not test what the guards see."""
    return m.module if isinstance(m, ORTModule) else m


def _train_through(model: nn.Module, changes: dict[int, Change], steps: int = 6) -> ORTModule:
    """Train an ORTModule and an eager copy for ``steps``, applying ``changes[step]`` to both first."""
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step in range(steps):
        if step in changes:
            changes[step](wrapped)
            changes[step](eager)
        x, y = _batch(step)
        losses = []
        for m in (wrapped, eager):
            m.zero_grad(set_to_none=True)
            loss = m(x, y)
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), f"step {step}"
    assert_same_state(wrapped, eager, atol=1e-5)
    for (name, a), b in zip(wrapped.named_parameters(), eager.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
    return wrapped


def _capture_reasons(caplog: pytest.LogCaptureFixture, *args: Any, **kwargs: Any) -> list[str]:
    """:func:`_train_through` with INFO logs read: why each capture happened."""
    with caplog.at_level(logging.INFO, logger="ortrain"):
        _train_through(*args, **kwargs)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]


def test_unfreezing_a_layer_gives_it_gradients() -> None:
    torch.manual_seed(0)
    model = Net()
    model.encoder.fc.requires_grad_(False)
    wrapped = _train_through(model, {3: lambda m: m.encoder.fc.requires_grad_(True)})
    assert wrapped.encoder.fc.weight.grad is not None


def test_freezing_a_layer_stops_its_gradients() -> None:
    torch.manual_seed(0)
    wrapped = _train_through(Net(), {2: lambda m: m.head.requires_grad_(False)})
    assert wrapped.head.weight.grad is None


def test_a_parameter_replaced_deep_in_the_tree_is_the_one_trained() -> None:
    torch.manual_seed(0)
    new_weight = torch.randn(8, 8)

    def replace(m: nn.Module) -> None:
        m.encoder.fc.weight = nn.Parameter(new_weight.clone())

    wrapped = _train_through(Net(), {2: replace})
    assert wrapped.encoder.fc.weight.grad is not None


def test_a_replaced_submodule_is_captured_again() -> None:
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))

    def swap(m: nn.Module) -> None:
        m.head = copy.deepcopy(head)

    _train_through(Net(), {2: swap})


def test_a_submodule_switched_to_eval_mode(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")  # ORTModule sets the "ortrain" logger's level
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        wrapped = _train_through(Net(), {2: lambda m: m.encoder.bn.eval(), 4: lambda m: m.encoder.bn.train()})
    assert "submodule 'encoder.bn' was switched to eval mode" in caplog.text
    assert len(wrapped._ortrain_graphs) == 2  # back in train mode, the first graph is used again


def test_a_changed_plain_attribute_below_the_top_level() -> None:
    torch.manual_seed(0)

    def set_p(m: nn.Module) -> None:
        m.encoder.bn.eps = 0.5
        m.encoder.bn.momentum = 0.5

    _train_through(Net(), {2: set_p})


@dataclasses.dataclass
class _Settings:
    scale: float = 1.0
    gelu: bool = True
    nested: dict = dataclasses.field(default_factory=lambda: {"shift": 0.0})


class _ConfiguredNet(Net):
    """Reads its settings in the forward, as models with a config object do."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = _Settings()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x) * self.settings.scale + self.settings.nested["shift"]
        h = F.gelu(h) if self.settings.gelu else torch.tanh(h)
        return F.cross_entropy(self.head(h), y)


def test_a_changed_config_value_is_seen_and_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A value changed inside a config object the model holds: a new graph, named in the log (the
    graph used to keep the captured value: the loss stayed that of scale 1)."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")  # ORTModule sets the "ortrain" logger's level
    torch.manual_seed(0)

    def scale(m: nn.Module) -> None:
        m.settings.scale = 3.0

    def activation_and_nested(m: nn.Module) -> None:
        m.settings.gelu = False
        m.settings.nested["shift"] = 0.5

    reasons = _capture_reasons(caplog, _ConfiguredNet(), {2: scale, 4: activation_and_nested})
    held = "(a config held by '(the model)')"
    assert f"capturing a graph: settings.scale changed from 1.0 to 3.0 {held}" in reasons
    assert f"capturing a graph: settings.gelu changed from True to False {held}" in reasons
    assert len(reasons) == 3  # the first call and the two changes: an unchanged config captures nothing


class _TableConfiguredNet(Net):
    """Settings kept in a plain dict, a set and a SimpleNamespace on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_weights = {"main": 1.0, "l2": 0.0}
        self.flags: set[str] = set()
        self.schedule = types.SimpleNamespace(scale=1.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x) * self.schedule.scale
        h = F.gelu(h) if "gelu" in self.flags else torch.tanh(h)
        loss = F.cross_entropy(self.head(h), y) * self.loss_weights["main"]
        return loss + self.loss_weights["l2"] * h.square().mean()


def test_a_changed_dict_set_or_namespace_value_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 23: a module's dicts and sets were not watched at all and a SimpleNamespace by identity
    only: the graph kept the values it was captured with (an l2 weight that never came on)."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)

    def weight(m: nn.Module) -> None:
        m.loss_weights["l2"] = 0.5

    def flag(m: nn.Module) -> None:
        m.flags.add("gelu")

    def scale(m: nn.Module) -> None:
        m.schedule.scale = 2.0

    reasons = _capture_reasons(caplog, _TableConfiguredNet(), {1: weight, 2: flag, 4: scale})
    assert len(reasons) == 4, reasons
    assert "loss_weights.l2 changed from 0.0 to 0.5 (a dict held by '(the model)')" in reasons[1]
    assert "flags.members changed" in reasons[2]
    assert "schedule.scale changed from 1.0 to 2.0" in reasons[3]


class _Progress:
    def __init__(self) -> None:
        self.epoch = 0


class _KLAnnealing:
    """A schedule object of the user's own (not a config): the loop moves it, the forward reads it."""

    def __init__(self) -> None:
        self.beta = 0.0
        self.progress = _Progress()
        self.device = torch.device("cpu")  # rebound by the loop at every step: not baked in


class _AnnealedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.annealing = _KLAnnealing()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        penalty = h.square().mean() * (self.annealing.beta + 0.1 * self.annealing.progress.epoch)
        return F.cross_entropy(self.head(h), y) + penalty


def test_a_value_of_an_object_the_model_holds_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 30: an instance of the user's own class was watched by identity only, and the graph
    kept the beta it was captured with (the loss off by 0.6 by the fourth step, silently). Its
    plain values are read at every step, two objects deep; a device it rebinds is no change."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)

    def beta(m: nn.Module) -> None:
        m.annealing.beta = 0.5

    def epoch(m: nn.Module) -> None:
        m.annealing.progress.epoch = 1

    def device(m: nn.Module) -> None:
        m.annealing.device = torch.device("cpu")

    reasons = _capture_reasons(caplog, _AnnealedNet(), {1: device, 2: beta, 3: device, 4: epoch})
    assert len(reasons) == 3, reasons
    assert reasons[1].endswith("annealing.beta changed from 0.0 to 0.5 (an object held by '(the model)')")
    assert "annealing.progress.epoch changed from 0 to 1 (an object held by" in reasons[2]


def test_deepspeeds_state_on_a_module_is_not_read_as_the_models(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSpeed ZeRO-3 keeps objects of its own on the modules it hooks (``ds_*``), changed at
    every step: read as held objects, each step would capture again."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = Net()
    model.ds_progress = _Progress()

    def step(m: nn.Module) -> None:
        m.ds_progress.epoch += 1

    reasons = _capture_reasons(caplog, model, dict.fromkeys(range(1, 4), step))
    assert reasons == ["capturing a graph: first call"]


def test_accelerates_hooks_record_devices_without_a_second_capture(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """accelerate's hook sets ``_hf_hook.input_device`` at every call: read as the model's state,
    the first step ran eagerly after its capture and the model was captured twice."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = Net()
    add_hook_to_module(model.encoder, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    assert _capture_reasons(caplog, model, {}) == ["capturing a graph: first call"]


class _ScaledByAttributes(Net):
    """Reads Python attributes set on a parameter and on its input, as flags."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scale = getattr(self.head.weight, "logit_scale", 1.0) * getattr(x, "scale", 1.0)
        return F.cross_entropy(self.head(torch.tanh(self.encoder(x))) * scale, y)


def test_python_attributes_of_a_parameter_and_an_input_are_read_and_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 30: the capture traced fake tensors without the real ones' Python attributes (the
    forward read the default, 1.0), and the key did not hold them either."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = _ScaledByAttributes()

    def attribute(value: float) -> Change:
        return lambda m: setattr(m.head.weight, "logit_scale", value)  # deepcopy drops it: set both

    reasons = _capture_reasons(caplog, model, {0: attribute(2.0), 2: attribute(3.0)})
    assert len(reasons) == 2, (reasons, caplog.text[-3000:])
    assert "Python attributes of parameter 'head.weight' changed" in reasons[1]
    wrapped, eager = ORTModule(copy.deepcopy(model)), model
    attribute(3.0)(wrapped)
    x, y = _batch(0)
    flagged = x.clone()
    flagged.scale = 0.5
    for inputs in ((x, y), (flagged, y)):
        assert wrapped(*inputs).item() == pytest.approx(eager(*inputs).item(), rel=1e-5)


_ANNEALING = _KLAnnealing()  # a module-level schedule object


class _SharedScheduleNet(Net):
    """Weights kept on the class and on a module-level object, shared by every instance."""

    LOSS_WEIGHTS: ClassVar[dict[str, float]] = {"l2": 0.0}  # as research code keeps one

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        penalty = h.square().mean() * (self.LOSS_WEIGHTS["l2"] + _ANNEALING.beta)
        return F.cross_entropy(self.head(h), y) + penalty


def test_a_class_level_table_and_a_global_object_are_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 30: a dict on the class and a module-level object of the user's class were not read,
    and the graph kept the weights it was captured with."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    monkeypatch.setattr(_SharedScheduleNet, "LOSS_WEIGHTS", {"l2": 0.0})
    monkeypatch.setattr(_ANNEALING, "beta", 0.0)
    torch.manual_seed(0)

    def table(m: nn.Module) -> None:  # eager and ORTModule share the class and the global
        _SharedScheduleNet.LOSS_WEIGHTS["l2"] = 0.5

    def schedule(m: nn.Module) -> None:
        _ANNEALING.beta = 0.25

    reasons = _capture_reasons(caplog, _SharedScheduleNet(), {2: table, 4: schedule})
    assert len(reasons) == 3, reasons
    assert "_SharedScheduleNet.LOSS_WEIGHTS.l2 changed from 0.0 to 0.5" in reasons[1]
    assert "_ANNEALING.beta changed from 0.0 to 0.25" in reasons[2]


class _PrivatelySwitchedNet(Net):
    """Switches kept in private attributes, as research code keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self._skip_activation = False
        self._scale = 1.0
        self._weights = {"l2": 0.0}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x) * self._scale
        h = h if self._skip_activation else torch.tanh(h)
        return F.cross_entropy(self.head(h), y) + self._weights["l2"] * h.square().mean()


def test_a_changed_private_value_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 27: attributes whose names start with an underscore were not watched: the graph kept
    the branch and the values it was captured with."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)

    changes: dict[int, Change] = {
        1: lambda m: setattr(_unwrapped(m), "_skip_activation", True),
        2: lambda m: setattr(_unwrapped(m), "_scale", 2.0),
        3: lambda m: _unwrapped(m)._weights.update(l2=0.5),
    }
    reasons = _capture_reasons(caplog, _PrivatelySwitchedNet(), changes, steps=5)
    assert len(reasons) == 4, reasons
    assert "_skip_activation changed from False to True" in reasons[1]
    assert "_scale changed from 1.0 to 2.0" in reasons[2]
    assert "_weights.l2 changed from 0.0 to 0.5" in reasons[3]


class _PerLayerSettingsNet(Net):
    """Per-layer settings kept as a list of dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [{"scale": 1.0}, {"scale": 1.0, "act": "tanh"}]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x) * self.layers[0]["scale"]
        h = torch.tanh(h) if self.layers[1]["act"] == "tanh" else F.gelu(h)
        return F.cross_entropy(self.head(h * self.layers[1]["scale"]), y)


def test_a_changed_value_in_a_list_of_dicts_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 27: a list of dicts was watched by its identity only: ``self.layers[1]["scale"] = 2.0``
    between steps kept the captured value, silently."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)

    changes: dict[int, Change] = {
        1: lambda m: _unwrapped(m).layers[1].update(scale=2.0),
        2: lambda m: _unwrapped(m).layers[1].update(act="gelu"),
    }
    reasons = _capture_reasons(caplog, _PerLayerSettingsNet(), changes, steps=4)
    assert len(reasons) == 3, reasons
    assert "layers.1.scale changed from 1.0 to 2.0" in reasons[1]
    assert "layers.1.act changed from 'tanh' to 'gelu'" in reasons[2]


@dataclasses.dataclass
class _LazySettings:
    mode: str | None = None


class _LazilyConfiguredNet(Net):
    """Fills its config on its first call, as Hugging Face's sequence classifiers set
    ``config.problem_type``."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = _LazySettings()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.settings.mode is None:
            self.settings.mode = "tanh" if y.dtype == torch.int64 else "relu"
        h = self.encoder(x)
        return F.cross_entropy(self.head(torch.tanh(h) if self.settings.mode == "tanh" else h), y)


def test_a_config_value_the_forward_sets_while_captured_needs_no_second_capture() -> None:
    torch.manual_seed(0)

    def relu(m: nn.Module) -> None:
        m.settings.mode = "relu"

    wrapped = _train_through(_LazilyConfiguredNet(), {4: relu})
    assert wrapped.module.settings.mode == "relu"
    assert len(wrapped._ortrain_graphs) == 2  # the first call's graph, kept for mode "tanh"; then "relu"


class _ClassScaledNet(Net):
    SCALE = 1.0  # a class-level setting, changed at run time below

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encoder(x) * self.SCALE), y)


def test_a_changed_class_attribute_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``Net.SCALE = 3.0`` between steps: a new graph (the captured one kept 1.0)."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    monkeypatch.setattr(_ClassScaledNet, "SCALE", 1.0)  # put back after the test
    torch.manual_seed(0)

    def scale(m: nn.Module) -> None:
        _ClassScaledNet.SCALE = 3.0

    with caplog.at_level(logging.INFO, logger="ortrain"):
        _train_through(_ClassScaledNet(), {2: scale})
    assert "capturing a graph: class attribute _ClassScaledNet.SCALE changed from 1.0 to 3.0" in caplog.text


class _ClassConfiguredNet(Net):
    CFG = types.SimpleNamespace(scale=1.0)  # a config object on the class, shared by instances

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encoder(x) * self.CFG.scale), y)


def test_a_changed_config_object_on_the_class_is_seen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``Net.CFG.scale = 3.0`` between steps: until wave 41 a config object held by the class (not
    the instance) was not watched, and the captured graph kept 1.0 (loss -1.656, eager -0.184)."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    monkeypatch.setattr(_ClassConfiguredNet.CFG, "scale", 1.0)  # put back after the test
    torch.manual_seed(0)

    def scale(m: nn.Module) -> None:
        _ClassConfiguredNet.CFG.scale = 3.0

    reasons = _capture_reasons(caplog, _ClassConfiguredNet(), {2: scale})
    assert len(reasons) == 2 and "_ClassConfiguredNet.CFG" in reasons[1], reasons


def test_a_hugging_face_config_flag_set_between_steps_is_seen() -> None:
    """``model.config.output_hidden_states = True`` after a few steps returns the hidden states, as
    eager does (the captured graph returned none)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager", use_cache=False,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step in range(4):
        if step == 2:
            for m in (wrapped.module, eager):
                m.config.output_hidden_states = True
        ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(step))
        outputs = [m(input_ids=ids, labels=ids) for m in (wrapped, eager)]
        assert outputs[0].loss.item() == pytest.approx(outputs[1].loss.item(), rel=1e-5)
        if step < 2:
            assert outputs[0].hidden_states is None and outputs[1].hidden_states is None
        else:
            assert len(outputs[0].hidden_states) == len(outputs[1].hidden_states) == 3
            for ours, theirs in zip(outputs[0].hidden_states, outputs[1].hidden_states, strict=True):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        for m, out in zip((wrapped, eager), outputs, strict=True):
            m.zero_grad()
            out.loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert_same_state(wrapped, eager, atol=1e-5)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = torch.tanh  # a function kept as an attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


class _DoublingHolder(_Holder):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.act(x)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3, padding=1)
        self.holder = _Holder()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.holder(self.conv(x[:, None, :])).mean(-1)
        return F.cross_entropy(self.head(features), y)


def test_a_patched_forward_a_swapped_function_and_a_changed_tuple_are_seen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The guards compared plain numbers, strings and tensors: a class swapped on an instance, a
    ``forward`` patched on it (as accelerate wraps one), a function kept as an attribute, or a
    conv's ``padding`` (a tuple) changed while the old graph went on running the old model."""
    torch.manual_seed(0)

    def patch_forward(m: nn.Module) -> None:
        conv = m.conv
        original = conv.forward
        conv.forward = lambda x: original(x) * 2.0

    def swap_function(m: nn.Module) -> None:
        m.holder.act = torch.sigmoid

    def change_padding(m: nn.Module) -> None:
        m.conv.padding = (0,)

    def swap_class(m: nn.Module) -> None:
        m.holder.__class__ = _DoublingHolder

    changes = {1: swap_class, 2: patch_forward, 3: swap_function, 4: change_padding}
    with caplog.at_level(logging.INFO, logger="ortrain.ortmodule"):
        _train_through(_ConvNet(), changes, steps=6)
    assert "the class of submodule 'holder' changed to _DoublingHolder" in caplog.text
    assert "attribute 'forward' of 'conv' was replaced" in caplog.text
    assert "attribute 'act' of 'holder' was replaced" in caplog.text
    assert "conv.padding changed from (1,) to (0,)" in caplog.text


def test_deepspeed_hook_state_set_at_every_step_is_not_watched(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed ZeRO-3's hooks set functions on each module at every step (``pre_bwd_fn``,
    ``ds_*``): watched as held functions, they captured the model again at every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    wrapped = ORTModule(model)
    x = torch.randn(3, 4)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(4):
            for m in model.modules():
                m.pre_bwd_fn = lambda *grads: grads  # a new function each step, as ZeRO-3's hooks set
                m.ds_step_fn = functools.partial(torch.mul, other=float(step))
            wrapped(x).sum().backward()
    captures = [r for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    assert len(captures) == 1


def test_a_forward_hook_added_after_capture_runs() -> None:
    torch.manual_seed(0)

    def hook(m: nn.Module) -> None:
        m.encoder.fc.register_forward_hook(lambda _mod, _inp, out: out * 2)

    _train_through(Net(), {3: hook})


class _LayoutBranches(nn.Module):
    """Branches on its input's layout, as channels-last code paths do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if x.is_contiguous(memory_format=torch.channels_last):
            h = h * 2
        elif not x.is_contiguous():
            h = h + 1
        return h.square().mean()


def test_an_input_of_another_memory_layout_is_captured_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 27: a graph traced on a contiguous input also ran a channels-last or a transposed one
    of the same sizes, taking the contiguous input's branch (losses silently off eager's)."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    eager = _LayoutBranches()
    wrapped = ORTModule(copy.deepcopy(eager))
    layouts = [
        lambda x: x,
        lambda x: x.to(memory_format=torch.channels_last),
        lambda x: x.transpose(2, 3).contiguous().transpose(2, 3),
        lambda x: x,
    ]
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step, layout in enumerate(layouts):
            x = layout(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step)))
            losses = [m(x) for m in (eager, wrapped)]
            for loss in losses:
                loss.backward()
            assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6), f"step {step}"
            for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad)
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    assert len(reasons) == 3, reasons  # the last step runs the first graph again
    assert (
        "from float32 of rank 4 on cpu, contiguous to float32 of rank 4 on cpu, channels_last" in (reasons[1])
    )
    assert reasons[2].endswith("to float32 of rank 4 on cpu, strided")


def test_dtype_change_after_some_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step in range(4):
        if step == 2:
            wrapped.double()
            eager.double()
        x = _batch(step)[0].to(next(eager.parameters()).dtype)
        for m in (wrapped, eager):
            m.zero_grad()
            m(x).pow(2).mean().backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert next(wrapped.parameters()).dtype == torch.float64
    assert_same_state(wrapped, eager, atol=1e-6)


class _MakesItsPositions(nn.Module):
    """Positions made in the default dtype and added to the input: the output's dtype follows it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.arange(x.shape[0])[:, None] / 3


def test_a_changed_default_dtype_is_captured_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 28 kept the graph across ``torch.set_default_dtype``: the positions stayed float32 and
    so did the output, where eager's became float64."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    eager = _MakesItsPositions()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 4)
    before = torch.get_default_dtype()
    with caplog.at_level(logging.INFO, logger="ortrain"):
        try:
            for step in range(4):
                if step == 2:
                    torch.set_default_dtype(torch.float64)
                outputs = [m(x) for m in (eager, wrapped)]
                assert outputs[1].dtype == outputs[0].dtype, f"step {step}"
                torch.testing.assert_close(outputs[1], outputs[0])
        finally:
            torch.set_default_dtype(before)
    assert "the default dtype changed from torch.float32 to torch.float64" in caplog.text


class _AddsZerosOfTheDefaultDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) + torch.zeros(x.shape[0], 4)).double().pow(2).mean()


def test_training_under_another_default_dtype_runs_on_onnx_runtime() -> None:
    """Wave 33: the graph captured under float64 exported ``torch.zeros`` as float32, ONNX Runtime
    had no ``Add`` kernel for float64 with float32, and the model fell back to PyTorch (here,
    without a fallback, it failed)."""
    torch.manual_seed(0)
    eager = _AddsZerosOfTheDefaultDtype()
    wrapped = ORTModule(copy.deepcopy(eager))
    before = torch.get_default_dtype()
    try:
        for step in range(4):
            torch.set_default_dtype(torch.float64 if step % 2 else torch.float32)
            x = torch.randn(3, 4, dtype=torch.float32)
            losses = []
            for m in (eager, wrapped):
                m.zero_grad()
                loss = m(x)
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0])
            assert_same_state(wrapped, eager)
    finally:
        torch.set_default_dtype(before)


def test_deterministic_algorithms_switched_on_between_steps_capture_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 34: the graph captured without ``torch.use_deterministic_algorithms`` was kept when a
    script switched it on, and AOTAutograd's backward refused to run ("This compiled backward
    function is being run with torch.use_deterministic_algorithms(True)...")."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped = ORTModule(copy.deepcopy(eager))
    before = torch.are_deterministic_algorithms_enabled()
    with caplog.at_level(logging.INFO, logger="ortrain"):
        try:
            for step in range(4):
                torch.use_deterministic_algorithms(step % 2 == 1)
                x = torch.randn(3, 4)
                for m in (eager, wrapped):
                    m.zero_grad()
                    m(x).square().mean().backward()
                for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
                    torch.testing.assert_close(q.grad, p.grad)
        finally:
            torch.use_deterministic_algorithms(before)
    # Switched off again, the step finds the first graph: two captures in all.
    assert caplog.text.count("capturing a graph:") == 2
    assert "torch.use_deterministic_algorithms was switched on" in caplog.text


class _HalvedInInferenceMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h * 0.5 if torch.is_inference_mode_enabled() else h


def test_no_grad_and_inference_mode_get_a_graph_each(caplog: pytest.LogCaptureFixture) -> None:
    """Until wave 43 the graph captured under ``torch.no_grad()`` ran under
    ``torch.inference_mode()`` (and the other way round): a forward branching on
    ``torch.is_inference_mode_enabled()`` got the other branch, silently."""
    torch.manual_seed(0)
    eager = _HalvedInInferenceMode()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 4)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for mode in (torch.no_grad, torch.inference_mode, torch.no_grad, torch.inference_mode):
            with mode():
                torch.testing.assert_close(wrapped(x), eager(x))
    assert caplog.text.count("capturing a graph:") == 2
    assert "torch.inference_mode was switched on" in caplog.text


def test_parameters_swapped_in_place_after_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 26: ``torch.utils.swap_tensors`` (``model.double()`` under
    ``set_swap_module_params_on_conversion``) refused the captured model's parameters: the
    capture's fake modes held weak references to them ("Cannot swap t1 because it has weakref
    associated with it")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    weight = model[0].weight
    for step in range(3):
        if step == 1:
            monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
            wrapped.double()
            eager.double()
            monkeypatch.undo()
        x = _batch(step)[0].to(next(eager.parameters()).dtype)
        for m in (wrapped, eager):
            m.zero_grad()
            m(x).pow(2).mean().backward()
    assert model[0].weight is weight and weight.dtype == torch.float64  # the same object, swapped
    assert_same_state(wrapped, eager, atol=1e-6)
    for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, temperature: float, mode: str = "ce") -> torch.Tensor:
        logits = self.fc(x) / temperature
        if mode == "ce":
            return F.cross_entropy(logits, y)
        return logits.pow(2).mean() * (2.0 if mode == "double" else 1.0)


def test_a_scheduled_float_becomes_an_input_after_its_second_value(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = Scaled()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    caplog.set_level(logging.INFO, logger="ortrain")
    for step in range(6):
        temperature = 1.0 + 0.25 * step
        x, y = _batch(step)
        for m in (wrapped, eager):
            m.zero_grad()
            loss = m(x, y, temperature)
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert_same_state(wrapped, eager, atol=1e-6)
    assert len(wrapped._ortrain_graphs) == 2  # the first value baked in, then one graph for all
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    # Until wave 32: "... changed from 1.0 to a tensor".
    lifted = "input 2 changed from 1.0; it is an input of the graph from now on"
    assert reasons[1] == f"capturing a graph: {lifted}"


class Cropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        return self.fc(x)[:, :keep].pow(2).mean()  # ``keep`` must stay a Python int


def test_a_number_the_model_needs_as_a_python_number_is_baked_in_per_value() -> None:
    torch.manual_seed(0)
    model = Cropped()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step, keep in enumerate((3, 5, 6, 5)):
        x = _batch(step)[0]
        for m in (wrapped, eager):
            m.zero_grad()
            m(x, keep).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert_same_state(wrapped, eager, atol=1e-6)
    assert len(wrapped._ortrain_graphs) == 3


class _Pooled(nn.Module):
    """A GNN's readout: the graph count is an int the model needs as a size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return torch.zeros(num_graphs, 8).index_add(0, batch, h).pow(2).mean()


def test_a_number_baked_in_per_value_opens_the_sizes_its_other_values_needed_open() -> None:
    """Wave 47's review: a GNN whose graph count is baked in per value, on batches whose node count
    changes at every step, captured each value twice (its sizes fixed, then open). A new value's
    first capture now opens the sizes that another value's graphs needed open."""
    torch.manual_seed(0)
    model = _Pooled()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step, (nodes, graphs) in enumerate(((5, 2), (7, 2), (6, 3), (9, 3), (8, 4), (11, 4))):
        x = torch.randn(nodes, 8, generator=torch.Generator().manual_seed(step))
        batch = torch.arange(nodes) % graphs
        for m in (wrapped, eager):
            m.zero_grad()
            m(x, batch, graphs).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    # 2 graphs: fixed, then open sizes; 3 and 4: one graph each, with open sizes (6 until wave 48).
    assert [len(group) for group in wrapped._ortrain_graphs.values()] == [2, 1, 1]


class _Phased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, temperature: float, phase: int) -> torch.Tensor:
        h = self.fc(x) / temperature
        if phase % 3 == 0:  # ``phase`` must stay a Python int, ``temperature`` need not
            h = h * 2
        return h.pow(2).mean()


def test_of_two_changing_numbers_only_the_one_the_model_needs_is_baked_in(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wave 26: a temperature from a schedule next to a phase the model branches on. Both changed
    at the second step, the capture with both as tensors failed, and both were refused: every
    step captured a graph. Now only ``phase`` is baked in: one graph per phase, then none."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = _Phased()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    captures_per_step = []
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(9):
            caplog.clear()
            x = _batch(step)[0]
            for m in (wrapped, eager):
                m.zero_grad()
                m(x, 1.0 + 0.1 * step, step % 3).backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.1 * p.grad
            captures_per_step.append(
                sum(r.getMessage().startswith("capturing a graph:") for r in caplog.records)
            )
    assert_same_state(wrapped, eager, atol=1e-6)
    # the first call; both lifted (fails), the temperature alone; the phase too (fails), phase 2
    # baked in; phase 0 with the temperature lifted; then every graph is there.
    assert captures_per_step == [1, 2, 2, 1, 0, 0, 0, 0, 0]
    assert len(wrapped._ortrain_graphs) == 4


class _IntOrTensor(nn.Module):
    """Picks a token by a Python int, pools otherwise: Hugging Face's ``logits_to_keep`` style."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pick: int, salt: int) -> torch.Tensor:
        h = self.fc(x)
        h = h[:, pick] if isinstance(pick, int) else h.mean(1)
        return h.pow(2).mean() + (salt * 2654435761) % 1000


def test_a_number_the_graph_does_not_read_or_that_overflows_stays_a_constant() -> None:
    """A lifted number was a tensor to the model: ``isinstance(pick, int)`` took the other branch
    and the graph ignored it (silently another loss), and a large int overflowed int64 inside the
    graph where Python's does not (429 instead of 661). Both now capture per value."""
    torch.manual_seed(0)
    model = _IntOrTensor()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x = torch.randn(2, 8)
    for pick, salt in ((1, 1), (2, 1), (3, 12345678901), (2, 7)):
        expected = eager(x.unsqueeze(1).expand(2, 4, 8), pick, salt)
        got = wrapped(x.unsqueeze(1).expand(2, 4, 8), pick, salt)
        torch.testing.assert_close(got, expected)


def test_the_cache_is_bounded_and_warns_once_naming_what_changes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_GRAPH_CACHE_SIZE", "2")
    wrapped = ORTModule(Scaled())
    x, y = _batch(0)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for mode in ("ce", "square", "double", "ce", "square"):
            wrapped(x, y, 1.0, mode)
    assert len(wrapped._ortrain_graphs) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "ORTMODULE_GRAPH_CACHE_SIZE" in warnings[0] and "input 3 changed" in warnings[0]


def test_bad_graph_cache_size_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_GRAPH_CACHE_SIZE", "0")
    with pytest.raises(ValueError, match="ORTMODULE_GRAPH_CACHE_SIZE"):
        ORTModule(Net())


def test_a_failed_step_changes_nothing() -> None:
    torch.manual_seed(0)
    model = Net()
    wrapped = ORTModule(model)
    wrapped(*_batch(0)).backward()
    model.encoder.bn.eval()  # the user freezes this BatchNorm
    state = copy.deepcopy(model.state_dict())
    bad = torch.randn(6, 5)
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        wrapped(bad, torch.zeros(6, dtype=torch.long))
    assert not model.encoder.bn.training and model.encoder.training and model.training
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_deepcopy_trains_independently_with_eager_parity() -> None:
    torch.manual_seed(0)
    wrapped = _train_through(Net(), {}, steps=2)
    twin = copy.deepcopy(wrapped)
    assert isinstance(twin, ORTModule) and len(twin._ortrain_graphs) == 0
    eager = copy.deepcopy(twin.module)
    before = copy.deepcopy(wrapped.state_dict())
    for step in range(3):
        x, y = _batch(10 + step)
        for m in (twin, eager):
            m.zero_grad()
            m(x, y).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert_same_state(twin, eager, atol=1e-5)
    for key, value in wrapped.state_dict().items():  # the original did not move
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_save_and_load_the_whole_wrapper(how: str) -> None:
    torch.manual_seed(0)
    wrapped = _train_through(Net(), {}, steps=2)
    if how == "pickle":
        restored = pickle.loads(pickle.dumps(wrapped))
    else:
        buffer = io.BytesIO()
        torch.save(wrapped, buffer)
        buffer.seek(0)
        restored = torch.load(buffer, weights_only=False)
    assert isinstance(restored, ORTModule)
    x, y = _batch(7)
    torch.testing.assert_close(restored(x, y), wrapped.module(x, y))
    assert len(restored._ortrain_graphs) == 1


def test_two_threads_train_two_models_at_once() -> None:
    results: dict[int, BaseException | None] = {}

    def train(seed: int) -> None:
        try:
            torch.manual_seed(seed)
            _train_through(Net(), {2: lambda m: m.encoder.bn.eval()}, steps=4)
            results[seed] = None
        except BaseException as error:  # reported below, on the main thread
            results[seed] = error

    threads = [threading.Thread(target=train, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert results == {1: None, 2: None}


def test_a_step_while_another_model_captures_keeps_its_graph(caplog: pytest.LogCaptureFixture) -> None:
    """A capture registers global module hooks (layer names for the memory summary) while it runs,
    on its thread: until wave 43 they were in every model's key, and two threads training their own
    models captured again at every step ("a global module hook was added or removed")."""
    from ortrain.capture.module_paths import annotate_module_paths

    wrapped = ORTModule(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
    with caplog.at_level(logging.INFO, logger="ortrain"):
        wrapped(torch.randn(4, 8)).square().mean().backward()
        with annotate_module_paths(nn.Linear(2, 2)):  # another model's capture, meanwhile
            wrapped(torch.randn(4, 8)).square().mean().backward()
    assert caplog.text.count("capturing a graph:") == 1


def test_a_thread_runs_one_model_while_another_captures_it() -> None:
    """One thread keeps running a graph of a model while another thread meets new graphs of the
    same model (other batch sizes, an input that requires grad). A capture swaps the model's
    parameters for fake ones while it traces: the running thread's forwards read them ("Please
    convert all Tensors to FakeTensors", and the model fell back to PyTorch for good). Both
    threads' outputs and input gradients equal eager's."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(30):  # past op tuning, whose steps wait for other threads' captures
            wrapped(x)
    errors: list[BaseException] = []
    capturing_done = threading.Event()

    def keep_running() -> None:
        try:
            runs = 0
            while not capturing_done.is_set() or runs < 5:
                with torch.no_grad():
                    torch.testing.assert_close(wrapped(x), eager(x))
                runs += 1
        except BaseException as error:  # reported below, on the main thread
            errors.append(error)

    def capture_new_graphs() -> None:
        try:
            for batch in (5, 6, 7):
                xb = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))
                results = []
                for model in (wrapped, eager):
                    xi = xb.clone().requires_grad_(True)
                    out = model(xi)
                    results.append((out, torch.autograd.grad(out.pow(2).sum(), xi)[0]))
                torch.testing.assert_close(results[0], results[1])
        except BaseException as error:
            errors.append(error)
        finally:
            capturing_done.set()

    threads = [threading.Thread(target=keep_running), threading.Thread(target=capture_new_graphs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == []
    assert not wrapped._ortrain_fallback.active
    # The running thread read no fake state: it captured nothing more (before, its forwards saw a
    # changed model and captured again, when they did not fail).
    alone = ORTModule(copy.deepcopy(eager))
    with torch.no_grad():
        alone(x)
    for batch in (5, 6, 7):
        alone(torch.randn(batch, 16).requires_grad_(True))
    assert _graph_count(wrapped) == _graph_count(alone)


def _graph_count(wrapped: ORTModule) -> int:
    return sum(len(entries) for entries in wrapped._ortrain_graphs.values())


def test_resized_token_embeddings_on_a_hugging_face_model() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)
    model.config.use_cache = False
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step in range(4):
        if step == 2:
            for m in (wrapped.module, eager):
                m.resize_token_embeddings(60)
            wrapped.module.load_state_dict(eager.state_dict())  # the same new rows in both
        vocab = 50 if step < 2 else 60
        ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(step))
        losses = []
        for m in (wrapped, eager):
            m.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert wrapped.module.lm_head.weight is wrapped.module.transformer.wte.weight
    assert_same_state(wrapped, eager, atol=1e-5)


def test_a_capture_at_every_call_for_one_reason_is_warned_about_with_what_to_do(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A step counter the loop sets on the model captured it again at every step, and nothing said
    so until the cache's eighth graph (wave 31: warned at the sixth such capture in a row)."""
    wrapped = ORTModule(Net())
    x, y = _batch(0)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for step in range(8):
            wrapped.module.global_step = step
            wrapped(x, y).backward()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "at each of the last 6 calls because (the model).global_step changed each time" in warnings[0]
    assert "(last: (the model).global_step changed from 5 to 6)" in warnings[0]


def test_captures_for_a_few_values_that_come_back_are_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrapped = ORTModule(Net())
    x, y = _batch(0)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for step in range(12):
            wrapped.module.task = ("a", "b", "c", "d")[step % 4]  # four tasks in turn: four graphs
            wrapped(x, y).backward()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(wrapped._ortrain_graphs) == 4


class _ReadsTensorAttributes(nn.Module):
    """Reads a NumPy array set on its weight and a list, a float and a NumPy scalar set on its input,
    with a loss no forward rewrite touches (so that AOTAutograd traces the module as written)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc.weight.column_scales = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * torch.from_numpy(self.fc.weight.column_scales)
        keep = [*getattr(x, "keep", [0, 1]), 2]
        return h[:, keep].sum() * getattr(x, "scale", 1.0) * float(getattr(x, "temperature", 1.0))


def test_tensor_attributes_reach_a_forward_traced_as_written() -> None:
    """Until wave 36 the functional tensors AOTAutograd traces with lost the attributes the fake
    tensors carried: the input's read the defaults (the loss off eager's, silently), the weight's
    failed the capture."""
    torch.manual_seed(0)
    model = _ReadsTensorAttributes()
    wrapped = ORTModule(copy.deepcopy(model))
    wrapped.module.fc.weight.column_scales = model.fc.weight.column_scales.copy()  # deepcopy drops it
    for keep, scale, temperature in (([0, 3], 0.25, np.float32(0.5)), ([1], 2.0, np.float32(0.5))):
        x = torch.randn(2, 4)
        x.keep, x.scale, x.temperature = keep, scale, temperature
        assert wrapped(x).item() == pytest.approx(model(x).item(), rel=1e-5)


@pytest.mark.parametrize(
    ("reason", "advice"),
    [
        ("input sizes changed", "pad the inputs to a few sizes"),
        ("input 'temp' changed from 0.3 to 0.4", "Pass it as a tensor"),
        ("(the model).global_step changed from 5 to 6", "watches every plain attribute"),
    ],
    ids=["sizes", "an argument", "an attribute"],
)
def test_the_capture_streak_warning_advises_for_what_changed(
    reason: str, advice: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The advice about attributes was given for sizes and arguments too (wave 45's review)."""
    from ortrain.ortmodule.graph_cache import GraphCache

    cache: GraphCache[int] = GraphCache(capacity=32)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for call in range(6):
            cache.add(call, call, reason)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert advice in warning


def test_the_eviction_warning_follows_the_streak_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The two warnings shared one flag: after the streak warning the user was never told that
    graphs were being evicted, nor about ORTMODULE_GRAPH_CACHE_SIZE (wave 52's review)."""
    from ortrain.ortmodule.graph_cache import STREAK, GraphCache

    cache: GraphCache[int] = GraphCache(capacity=STREAK + 2)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for call in range(3 * STREAK):
            cache.add(call, call, f"(the model).mode changed from {call} to {call + 1}")
    assert len(cache) == STREAK + 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert f"captured this model again at each of the last {STREAK} calls" in warnings[0]
    assert f"has captured more than {STREAK + 2} graphs" in warnings[1]
    assert "ORTMODULE_GRAPH_CACHE_SIZE" in warnings[1] and "(the model).mode changed" in warnings[1]


class _PhaseFlagNet(Net):
    phase = "d"

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return F.cross_entropy(self.head(h if self.phase == "d" else -h), y)


def test_a_value_alternated_through_the_wrapper_reuses_each_values_graph(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A GAN's ``model.phase = "d"`` / ``"g"`` set through the wrapper at every step dropped every
    graph (the setattr invalidated them all), and each step captured again, 170x slower (wave 46's
    review); the guards key the value, and each phase finds its graph."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")  # ORTModule sets the "ortrain" logger's level
    flips = {step: (lambda m, phase="dg"[step % 2]: setattr(m, "phase", phase)) for step in range(6)}
    reasons = _capture_reasons(caplog, _PhaseFlagNet(), flips)
    assert len(reasons) == 2, reasons


def test_pruning_the_roots_weight_through_the_wrapper_captures_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``prune.l1_unstructured(wrapped, "weight")`` on the wrapped model's own weight: it raised
    ``KeyError`` half-way (the wrapper's parameter table was its own, empty), and its mask, applied
    through the wrapper by a pre-hook at every step, then dropped every graph at every step."""
    from torch.nn.utils import prune

    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    for m in (eager, wrapped):
        prune.l1_unstructured(m, "weight", amount=0.5)
    assert list(wrapped.state_dict()) == list(eager.state_dict()) == ["bias", "weight_orig", "weight_mask"]
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(4):
            x = _batch(step)[0]
            losses = []
            for m in (eager, wrapped):
                m.zero_grad()
                loss = m(x).square().sum()
                loss.backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.01 * p.grad
                losses.append(loss.item())
            assert losses[0] == pytest.approx(losses[1], rel=1e-5), step
    captures = [r for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    assert len(captures) == 1, [r.getMessage() for r in captures]
    torch.testing.assert_close(wrapped.module.weight_orig, eager.weight_orig)
    prune.remove(wrapped, "weight")
    prune.remove(eager, "weight")
    assert isinstance(wrapped.module.weight, nn.Parameter)
    torch.testing.assert_close(wrapped(_batch(5)[0]), eager(_batch(5)[0]))


class _Selected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.sel: Any = [0, 1]
        self.mix = torch.eye(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) @ self.mix)[self.sel].square().mean()


@pytest.mark.parametrize("through", ["wrapper", "model"])
def test_a_list_and_an_equal_tuple_and_a_sparse_tensor_attribute_are_told_apart(
    through: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``h[self.sel]`` takes rows by a list and one element by a tuple: ``sel = (0, 1)`` after
    ``[0, 1]`` kept the list's graph (a loss 4.40 for eager's 0.0012); a tensor attribute replaced
    by a sparse one of the same shape ran the old graph and failed in it (wave 46's review)."""

    def change(value: Any, name: str) -> Change:
        return lambda m: setattr(m if through == "wrapper" else _unwrapped(m), name, value)

    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the default: a sparse product runs in PyTorch
    changes = {1: change((0, 1), "sel"), 2: change([0, 1], "sel"), 3: change(torch.eye(3).to_sparse(), "mix")}
    model = _Selected()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step in range(5):
        if step in changes:
            changes[step](wrapped)
            changes[step](eager)
        x = _batch(step)[0]
        losses = [m(x) for m in (wrapped, eager)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-7, msg=f"step {step}")
        torch.testing.assert_close(wrapped.fc.weight.grad, eager.fc.weight.grad, rtol=1e-5, atol=1e-6)


def test_the_same_value_set_again_through_the_wrapper_keeps_the_graphs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fresh ``float("nan")``, ``np.float32(0.5)`` or ``(0.5, 1.0)`` set through the wrapper at
    every step dropped every graph at every step, without a warning (wave 45's review)."""
    import numpy as np

    fresh = (lambda: float("nan"), lambda: np.float32(0.5), lambda: tuple([0.5, float(1)]))
    for make in fresh:
        wrapped = ORTModule(Net())
        x, y = _batch(0)
        with caplog.at_level(logging.INFO, logger="ortrain"):
            caplog.clear()
            for _ in range(4):
                wrapped.clip = make()  # a new object of the same value at every step
                wrapped(x, y).backward()
        captures = [r for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
        assert len(captures) == 1, (make(), [r.getMessage() for r in captures])


class _NamedHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 1), "b": nn.Linear(4, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        scale = {"a": 1.0, "b": 2.0, "c": 5.0}
        total = sum(scale[k] * head(h).sum() for k, head in self.heads.items())
        return total + (3 * self.proj(h).sum() if hasattr(self, "proj") else 0)


def test_a_submodule_moved_to_another_name_is_seen() -> None:
    """The same object at the same place of the walk under another name: the guards keyed the
    children without their names, and the old graph ran (wave 47's review: 0.12 for eager's 2.44)."""
    torch.manual_seed(0)
    eager = _NamedHeads()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    torch.testing.assert_close(wrapped(x), eager(x))
    for model in (eager, wrapped.module):
        model.heads["c"] = model.heads.pop("b")  # the same ModuleDict, a key renamed
    torch.testing.assert_close(wrapped(x), eager(x))
    for model in (eager, wrapped.module):
        head = model.heads["c"]
        del model.heads["c"]
        model.proj = head  # moved to an attribute of another name
    torch.testing.assert_close(wrapped(x), eager(x))
