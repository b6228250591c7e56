"""Debug options, environment variables, fallback policies and bad input."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys

import onnx
import pytest
import torch
from _parity import ort_graph_count
from torch import nn
from torch.nn import functional as F

from ortrain.ortmodule import (
    DebugOptions,
    FallbackPolicy,
    LogLevel,
    ORTModule,
    ORTModuleDeviceException,
    ORTModuleONNXModelException,
)
from ortrain.ortmodule.fallback import parse_fallback_policy
from ortrain.runtime.torch_native_ops import is_torch_native


class _Segments(nn.Module):
    """Captures fine, but ``segment_reduce`` (and its backward) has no ONNX translation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("lengths", torch.tensor([1, 2]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.softplus(self.linear(x))
        return torch.segment_reduce(h, "sum", lengths=self.lengths, axis=0).pow(2).sum()


def test_save_onnx_writes_one_loadable_file_per_stage_and_mode(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    model = ORTModule(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()), DebugOptions(save_onnx=True, onnx_prefix="mlp")
    )
    x = torch.randn(2, 4)
    model(x).sum().backward()
    model.eval()
    with torch.no_grad():  # eval() alone keeps gradients, as in eager: a training graph
        model(x)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        f"mlp_{graph}_{stage}_{mode}.onnx"
        for graph, mode in (("forward", "training"), ("backward", "training"), ("forward", "inference"))
        for stage in ("exported", "optimized")
    )
    for path in tmp_path.iterdir():
        onnx.checker.check_model(onnx.load(path))


def test_save_onnx_path_naming_a_file_is_refused_upfront(tmp_path, monkeypatch) -> None:
    a_file = tmp_path / "graphs"
    a_file.write_text("")
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(a_file))
    with pytest.raises(ValueError, match=r"ORTMODULE_SAVE_ONNX_PATH=.*is a file; name a directory"):
        ORTModule(nn.Linear(2, 2), DebugOptions(save_onnx=True))
    ORTModule(nn.Linear(2, 2))(torch.randn(1, 2))  # nothing saved: the path is not read


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: DebugOptions(save_onnx=True, onnx_prefix="run1/model"), ValueError, "names a folder"),
        (lambda: DebugOptions(save_onnx="no"), TypeError, "save_onnx must be True or False"),
        (lambda: DebugOptions(onnx_prefix=5), TypeError, "onnx_prefix must be a str"),
        (lambda: ORTModule(nn.Linear(2, 2), "verbose"), TypeError, "second argument is an ortrain"),
    ],
    ids=["prefix with a folder", "save_onnx a string", "prefix a number", "options a string"],
)
def test_debug_options_are_checked_when_made(make, error, message) -> None:
    """Until wave 44 they were not: a prefix naming a folder failed steps later and sent the model
    to PyTorch, `save_onnx="no"` wrote the files, and a string for the options failed on
    `'str' object has no attribute 'log_level'`."""
    with pytest.raises(error, match=message):
        make()


def test_log_level_from_environment_overrides_debug_options(monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    ORTModule(nn.Linear(2, 2), DebugOptions(log_level=LogLevel.ERROR))
    assert logging.getLogger("ortrain").level == logging.INFO
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="VERBOSE, DEVINFO, INFO, WARNING, ERROR, FATAL"):
        ORTModule(nn.Linear(2, 2))


def test_debug_variables_are_read_when_the_ortmodule_is_made(tmp_path, monkeypatch) -> None:
    """Until wave 53 ``DebugOptions`` read them when it was made: options made first (in a config
    module) wrote their graphs to the working directory and kept their own log level."""
    monkeypatch.delenv("ORTMODULE_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ORTMODULE_SAVE_ONNX_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    options = DebugOptions(save_onnx=True, log_level=LogLevel.WARNING)
    target = tmp_path / "graphs"
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(target))
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "ERROR")
    model = ORTModule(nn.Linear(3, 3), options)
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")  # after it is made: not read again
    model(torch.randn(2, 3)).sum().backward()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graphs"]
    assert "ortmodule_forward_exported_training.onnx" in {p.name for p in target.iterdir()}
    assert logging.getLogger("ortrain").level == logging.ERROR
    assert options.log_level is LogLevel.WARNING and options.save_path is None  # the user's, unchanged


def test_opset_version_from_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "20")
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    model = ORTModule(nn.Linear(3, 3), DebugOptions(save_onnx=True, onnx_prefix="o"))
    model(torch.randn(2, 3)).sum().backward()
    saved = onnx.load(tmp_path / "o_forward_exported_training.onnx")
    assert {o.domain: o.version for o in saved.opset_import}[""] == 20
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "twelve")
    with pytest.raises(ValueError, match="ORTMODULE_ONNX_OPSET_VERSION"):
        ORTModule(nn.Linear(3, 3))
    # Newer than the installed onnx: until wave 41 the graphs were exported at 18 without a word.
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", str(onnx.defs.onnx_opset_version() + 1))
    with pytest.raises(ValueError, match="newer than the installed onnx knows"):
        ORTModule(nn.Linear(3, 3))


def test_fallback_policy_names_parse_alone_and_joined() -> None:
    assert parse_fallback_policy("FALLBACK_DISABLE") == FallbackPolicy.FALLBACK_DISABLE
    assert parse_fallback_policy("FALLBACK_UNSUPPORTED_DEVICE|FALLBACK_UNSUPPORTED_ONNX_MODEL") == (
        FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE | FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL
    )
    assert parse_fallback_policy("FallbackPolicy.FALLBACK_FORCE_TORCH_FORWARD").forces_torch()
    with pytest.raises(ValueError, match="FALLBACK_NOPE"):
        parse_fallback_policy("FALLBACK_DISABLE|FALLBACK_NOPE")


def test_default_policy_runs_just_the_unsupported_operator_in_pytorch(monkeypatch, caplog) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    inner = _Segments()
    eager = copy.deepcopy(inner)
    wrapped = ORTModule(inner)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(3):
            x = torch.randn(3, 4)
            wrapped(x).backward()
            eager(x).backward()
    # One warning per graph, naming the operators that run in PyTorch; the rest stays in ORT.
    warnings = [r.getMessage() for r in caplog.records if "run in PyTorch because" in r.getMessage()]
    assert len(warnings) == 2
    assert warnings[0].startswith("forward graph") and "segment_reduce" in warnings[0]
    assert warnings[1].startswith("backward graph") and "segment_reduce_backward" in warnings[1]
    assert wrapped._ortrain_fallback.reason is None
    (entry,) = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    forward = entry.capture.forward.runner.plan.nodes_by_executor()
    assert forward["torch"] == 1 and forward["onnxruntime"] >= 4
    for a, b in zip(inner.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_fallback_disable_raises_naming_the_operator() -> None:
    with pytest.raises(ORTModuleONNXModelException, match=r"aten\.segment_reduce\.default"):
        ORTModule(_Segments())(torch.randn(3, 4))


def test_force_torch_policy_never_captures(monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_FORCE_TORCH_FORWARD")
    wrapped = ORTModule(nn.Linear(2, 2))
    wrapped(torch.randn(1, 2)).sum().backward()
    assert len(wrapped._ortrain_graphs) == 0


def test_wrong_shape_raises_pytorchs_error() -> None:
    wrapped = ORTModule(nn.Linear(4, 2))
    wrapped(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        wrapped(torch.randn(3, 5))


_WRONG_SHAPE = """
import torch
from ortrain import ORTModule
wrapped = ORTModule(torch.nn.Linear(4, 2))
wrapped(torch.randn(3, 4))
try:
    wrapped(torch.randn(3, 5))
except RuntimeError as error:
    print("raised:", error)
"""


def test_wrong_shape_prints_no_traceback_of_the_failed_capture() -> None:
    """PyTorch's one line, without fake tensors' forty lines of ERROR traceback before it (a fresh
    interpreter: torch's own log handler writes them to stderr, out of pytest's reach)."""
    done = subprocess.run([sys.executable, "-c", _WRONG_SHAPE], capture_output=True, text=True, check=True)
    assert "raised: mat1 and mat2 shapes cannot be multiplied" in done.stdout
    assert "failed while attempting to run meta" not in done.stderr


def test_wrong_dtype_raises_pytorchs_error() -> None:
    wrapped = ORTModule(nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="same dtype"):
        wrapped(torch.randn(3, 4, dtype=torch.float64))


def test_wrong_device_is_pytorchs_error_or_a_device_error_or_a_fallback(monkeypatch) -> None:
    wrapped = ORTModule(nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="expected device meta"):  # eager's: the user's to fix
        wrapped(torch.randn(3, 4, device="meta"))
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    wrapped = ORTModule(nn.Linear(4, 2).to("meta"))  # eager runs it: a device ortrain refuses
    with pytest.raises(ORTModuleDeviceException, match="meta"):
        wrapped(torch.randn(3, 4, device="meta"))
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_DEVICE")
    wrapped = ORTModule(nn.Linear(4, 2).to("meta"))
    out = wrapped(torch.randn(3, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 2)


def test_embedding_index_out_of_range_raises_pytorchs_error() -> None:
    wrapped = ORTModule(nn.Embedding(10, 4))
    wrapped(torch.tensor([1, 2]))
    assert ort_graph_count(wrapped) == 1
    with pytest.raises(IndexError, match="index out of range"):
        wrapped(torch.tensor([1, 12]))


@pytest.mark.parametrize(
    ("make", "index", "message"),
    [
        (lambda: nn.Embedding(10, 4), torch.tensor([1, -1]), "index out of range"),
        (lambda: _Classifier(ignore_index=-100), torch.tensor([0, -1, 2]), "Target -1 is out of bounds"),
        (lambda: _Classifier(ignore_index=0), torch.tensor([0, -1, 2]), "Target -1 is out of bounds"),
    ],
    ids=["embedding", "label -1 not ignored", "label -1 with another ignore_index"],
)
def test_a_negative_index_raises_pytorchs_error(make, index, message) -> None:
    """Wave 34: ONNX Runtime's gathers count a negative index from the end, so a label of -1 that
    the loss did not ignore trained silently on the last class, and embedding row -1 read the
    last row, where PyTorch raises."""
    wrapped = ORTModule(make())
    wrapped(index.abs())
    assert ort_graph_count(wrapped) == 1
    with pytest.raises(IndexError, match=message):
        wrapped(index)


class _Classifier(nn.Module):
    def __init__(self, ignore_index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.ignore_index = ignore_index

    def forward(self, target: torch.Tensor) -> torch.Tensor:
        features = torch.ones(target.shape[0], 4)
        return nn.functional.cross_entropy(self.linear(features), target, ignore_index=self.ignore_index)


def test_int32_class_labels_raise_pytorchs_error() -> None:
    """Wave 34: the capture's NLL (decomposed, or fused with the head) indexed with int32 labels,
    which PyTorch's loss refuses: a script ran under ortrain and failed without it."""
    wrapped = ORTModule(_Classifier(ignore_index=-100))
    wrapped(torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="expected target dtype to be Long or Byte, but got Int"):
        wrapped(torch.tensor([0, 1, 2], dtype=torch.int32))


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_uint8_class_labels_train_as_pytorch_reads_them(ignore_index: int) -> None:
    """Wave 35: PyTorch's decomposition of the loss gathered with uint8 labels, which ``gather``
    refuses, so the capture failed and the model trained in PyTorch (FALLBACK_DISABLE: an error)."""
    model = _Classifier(ignore_index=ignore_index)
    wrapped = ORTModule(copy.deepcopy(model))
    labels = torch.tensor([0, 1, 2, 2, 1], dtype=torch.uint8)
    expected, got = model(labels), wrapped(labels)
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    torch.testing.assert_close(wrapped.module.linear.weight.grad, model.linear.weight.grad)


class _Segmenter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.conv(image), mask)


def test_uint8_labels_of_a_4d_loss_raise_pytorchs_error() -> None:
    """``nll_loss2d`` refuses uint8 labels in eager; the capture refuses them the same way."""
    wrapped = ORTModule(_Segmenter())
    image = torch.randn(1, 3, 2, 2)
    wrapped(image, torch.zeros(1, 2, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="expected scalar type Long but found Byte"):
        wrapped(image, torch.zeros(1, 2, 2, dtype=torch.uint8))


class _BinaryClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, target: torch.Tensor) -> torch.Tensor:
        features = torch.ones(target.shape[0], 4)
        return nn.functional.binary_cross_entropy(torch.sigmoid(self.linear(features)).squeeze(-1), target)


def test_a_binary_target_outside_0_1_raises_pytorchs_error() -> None:
    """Wave 34: ONNX Runtime's translation has no check on values, so a 0/255 mask given as the
    target trained on a meaningless loss; binary_cross_entropy now runs in PyTorch, which raises."""
    model = _BinaryClassifier()
    wrapped = ORTModule(copy.deepcopy(model))
    target = torch.tensor([0.0, 1.0, 1.0])
    torch.testing.assert_close(wrapped(target), model(target))
    with pytest.raises(RuntimeError, match="all elements of target should be between 0 and 1"):
        wrapped(torch.tensor([0.0, 255.0, 1.0]))


class _Buckets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(8))

    def forward(self, position: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
        return self.table[torch.div(position, width, rounding_mode="trunc").clamp(0, 7)]


def test_an_integer_division_by_zero_raises_pytorchs_error() -> None:
    """Wave 35: ONNX Runtime's integer Div returned the most negative int64 for a zero divisor
    (clamped, a valid bucket: training went on); it now runs in PyTorch, which raises."""
    model = _Buckets()
    wrapped = ORTModule(copy.deepcopy(model))
    position = torch.tensor([0, 5, 13])
    torch.testing.assert_close(
        wrapped(position, torch.tensor([2, 2, 3])), model(position, torch.tensor([2, 2, 3]))
    )
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        model(position, torch.tensor([2, 0, 3]))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        wrapped(position, torch.tensor([2, 0, 3]))


class _RunningLogSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(scores * self.scale, dim=-1)


def test_logcumsumexp_keeps_prefixes_far_below_the_maximum() -> None:
    """Wave 35: onnxscript's translation takes one maximum for the whole dimension, so in ONNX
    Runtime ``[-100, 10, 3]`` gave ``-inf`` first and NaN gradients; it now runs in PyTorch."""
    model = _RunningLogSum()
    wrapped = ORTModule(copy.deepcopy(model))
    scores = torch.tensor([[-100.0, 10.0, 3.0], [-30.0, -20.0, 60.0]])
    expected, got = model(scores), wrapped(scores)
    torch.testing.assert_close(got, expected)
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(wrapped.module.scale.grad, model.scale.grad)
    assert torch.isfinite(wrapped.module.scale.grad)


class _Thumbnail(nn.Module):
    def __init__(self, **resize: object) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(9))
        self.resize = resize

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.interpolate(images * self.scale, antialias=True, **self.resize)


@pytest.mark.parametrize(
    "resize",
    [
        {"scale_factor": 0.6, "mode": "bilinear"},
        {"scale_factor": (1.0, 0.5), "mode": "bicubic"},
        {"size": (3, 4), "mode": "bilinear", "align_corners": True},
        {"size": (3, 4), "mode": "bicubic"},
    ],
    ids=["scale 0.6", "scales 1 and 0.5", "align corners", "size"],
)
def test_antialiased_resizes_are_pytorchs(resize: dict) -> None:
    """Wave 37: onnxscript's translation resized by the ratio of the sizes, ignoring the scale
    factor PyTorch maps coordinates with, and its align_corners is not PyTorch's: outputs off by
    0.5 where they were about 2. Those resizes now run in PyTorch; one asked for a size, which the
    translation gets right, stays in ONNX Runtime."""
    model = _Thumbnail(**resize)
    wrapped = ORTModule(copy.deepcopy(model))
    images = torch.randn(2, 3, 7, 9, generator=torch.Generator().manual_seed(0))
    expected, got = model(images), wrapped(images)
    torch.testing.assert_close(got, expected)
    (expected**2).sum().backward()
    (got**2).sum().backward()
    torch.testing.assert_close(wrapped.module.scale.grad, model.scale.grad)
    ((entry,),) = list(wrapped._ortrain_graphs.values())
    resizes = [n for n in entry.capture.forward.graph.graph.nodes if "_aa" in str(n.target)]
    assert len(resizes) == 1
    assert is_torch_native(resizes[0]) == ("size" not in resize or "align_corners" in resize)


class _PackedBits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, bits: torch.Tensor) -> torch.Tensor:
        return (bits << 1).float() * self.scale


def test_a_uint8_left_shift_wraps_as_pytorchs() -> None:
    """Wave 35: onnxscript's translation cast the shifted uint8 values to int8, so 200 << 1 came
    back as -112 where PyTorch wraps to 144; uint8 left shifts now run in PyTorch."""
    bits = torch.tensor([1, 100, 200, 255], dtype=torch.uint8)
    torch.testing.assert_close(ORTModule(_PackedBits())(bits), _PackedBits()(bits))


def test_negative_indices_that_pytorch_accepts_still_count_from_the_end() -> None:
    weight = torch.randn(5, 3)
    wrapped = ORTModule(_Picks(weight.clone()))
    index = torch.tensor([0, -1, -5])
    torch.testing.assert_close(wrapped(index), weight[index])
    assert ort_graph_count(wrapped) == 1


class _Picks(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.weight[index]


class _AddsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + y


def test_sizes_a_dynamic_graph_assumed_equal_raise_pytorchs_error_when_they_differ() -> None:
    wrapped = ORTModule(_AddsInput())
    for rows in (2, 3, 5):
        wrapped(torch.randn(rows, 4), torch.randn(rows, 3)).sum().backward()
    assert ort_graph_count(wrapped) == 2
    with pytest.raises(RuntimeError, match="must match the size"):
        wrapped(torch.randn(4, 4), torch.randn(6, 3))


def test_a_run_time_failure_that_pytorch_accepts_falls_back(monkeypatch, caplog) -> None:
    from ortrain.runtime.executors.ort import OrtSessionRunner

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    inner = nn.Linear(4, 3)
    wrapped = ORTModule(inner)
    x = torch.randn(2, 4)
    wrapped(x)

    def broken(self, args):
        raise RuntimeError("simulated ONNX Runtime failure")

    monkeypatch.setattr(OrtSessionRunner, "__call__", broken)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        torch.testing.assert_close(wrapped(x), inner(x))
    assert "simulated ONNX Runtime failure" in caplog.text


class _Energy(nn.Module):
    """A force field: forces are the energy's gradient, taken inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            positions = positions.detach().requires_grad_(True)
            energy = self.out(torch.tanh(self.hidden(positions))).sum()
            forces = -torch.autograd.grad(energy, positions, create_graph=self.training)[0]
        return energy, forces


def test_a_graph_that_fails_to_capture_runs_in_pytorch_alone(monkeypatch, caplog) -> None:
    """Its eval() capture fails (the inner backward frees what the capture's own backward reads):
    until wave 42 the model then trained in PyTorch for good; now only eval() calls do."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    model = _Energy()
    wrapped = ORTModule(copy.deepcopy(model))
    positions = torch.randn(5, 3)

    def step(m: nn.Module) -> torch.Tensor:
        energy, forces = m(positions)
        loss = (energy - 1) ** 2 + forces.square().mean()
        loss.backward()
        return loss

    torch.testing.assert_close(step(wrapped), step(model))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(2):
            wrapped.eval()
            model.eval()
            for got, want in zip(wrapped(positions), model(positions), strict=True):
                torch.testing.assert_close(got, want)
            wrapped.train()
            model.train()
            torch.testing.assert_close(step(wrapped), step(model))
    assert len([r for r in caplog.records if "could not capture this call's graph" in r.getMessage()]) == 1
    assert not wrapped._ortrain_fallback.active
    assert type(wrapped(positions)[0].grad_fn).__name__ == "_TwiceDifferentiableBackward"


class _EnergyInCallersMode(_Energy):
    """The same force field without its own ``enable_grad``: it differentiates in the caller's mode."""

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = positions.detach().requires_grad_(True)
        energy = self.out(torch.tanh(self.hidden(positions))).sum()
        forces = -torch.autograd.grad(energy, positions, create_graph=self.training)[0]
        return energy, forces


class _AuxiliaryBackwardInside(nn.Module):
    """A forward that runs a backward of its own (an auxiliary loss), then returns the main loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        (h.pow(2).mean() * 0.1).backward(retain_graph=True)
        return self.b(torch.tanh(h)).pow(2).mean()


def test_the_eager_check_runs_a_forward_that_differentiates_inside_in_the_callers_mode(
    monkeypatch, caplog
) -> None:
    """The check that asks eager PyTorch whether a failure is the user's ran without gradients, so a
    forward taking ``autograd.grad`` itself failed there ("element 0 of tensors does not require
    grad"), and that error was raised as the user's in place of the policy's fallback; a forward
    running its own backward, checked with gradients, must leave no gradient behind (wave 46)."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    model = _EnergyInCallersMode()
    wrapped = ORTModule(copy.deepcopy(model))
    positions = torch.randn(5, 3)
    wrapped(positions)[0].backward()
    model.eval()
    wrapped.eval()  # its capture fails: this graph's calls run in PyTorch
    for got, want in zip(wrapped(positions), model(positions), strict=True):
        torch.testing.assert_close(got, want)
    torch.manual_seed(0)
    model = _AuxiliaryBackwardInside()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(4, 6)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for m in (model, wrapped):
            m(x).backward()
    assert any("trains it in PyTorch instead" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(wrapped.a.weight.grad, model.a.weight.grad)


class _ListArgument(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
        return x * sum(t.sum() for t in tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _WritesItsInputAndAParameter(nn.Module):
    """Refused by the capture (an opaque Function given tensors in a list), so it falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        with torch.no_grad():
            self.scale.mul_(0.9)
        return self.linear(_ListArgument.apply(x, [y]) * self.scale).square().mean()


def test_the_call_that_falls_back_writes_into_its_input_and_parameters_once(monkeypatch, caplog) -> None:
    """Before falling back, ortrain asks eager PyTorch whether the failure is the user's: that run
    wrote into the input and the parameter too, so until wave 43 the call's loss was eager's on
    ``4 x`` and the scale 0.81."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "1")
    torch.manual_seed(0)
    model = _WritesItsInputAndAParameter()
    wrapped = ORTModule(copy.deepcopy(model))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(2):
            x, y = torch.randn(4, 8), torch.randn(3)
            x_eager, x_wrapped = x.clone(), x.clone()
            torch.testing.assert_close(wrapped(x_wrapped, y), model(x_eager, y))
            torch.testing.assert_close(x_wrapped, x_eager)
            torch.testing.assert_close(wrapped.scale, model.scale)
    assert "trains it in PyTorch instead" in caplog.text


def test_an_inference_tensor_raises_pytorchs_error_and_the_model_stays(monkeypatch) -> None:
    """The check ran without gradients, where inference tensors pass: until wave 43 one such batch
    sent the model to PyTorch for good under the default policy."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    wrapped = ORTModule(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    wrapped(torch.randn(4, 8)).sum().backward()
    with torch.inference_mode():
        made_in_inference = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        wrapped(made_in_inference).sum().backward()
    assert not wrapped._ortrain_fallback.active
    before = ort_graph_count(wrapped)
    wrapped(torch.randn(4, 8)).sum().backward()
    assert ort_graph_count(wrapped) == before and not wrapped._ortrain_fallback.active


class _AddsPositionsInPlace(nn.Module):
    def __init__(self, conditional: bool) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.randn(8))
        self.linear = nn.Linear(8, 8)
        self.conditional = conditional

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x += self.positions
        if self.conditional:  # torch.cond compiles itself in eager PyTorch
            x = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))
        return self.linear(_ListArgument.apply(x, [y])).square().mean()


@pytest.mark.parametrize("conditional", [False, True])
def test_the_call_that_falls_back_gives_eagers_gradients_through_an_input_it_writes(
    monkeypatch, conditional: bool
) -> None:
    """The check before the fallback ran under gradients in wave 43's first fix: its write into the
    input left autograd history on it, and the call's own write doubled the gradient reaching
    ``positions``; with ``torch.cond`` the check's dispatch mode failed the call."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "1")
    torch.manual_seed(0)
    model = _AddsPositionsInPlace(conditional)
    wrapped = ORTModule(copy.deepcopy(model))
    embedding = nn.Embedding(10, 8)
    ids, y = torch.randint(0, 10, (4,)), torch.randn(3)
    losses = [m(embedding(ids) * 1, y) for m in (model, wrapped)]
    grads = []
    for loss in losses:
        loss.backward()
        grads.append(embedding.weight.grad.clone())
        embedding.zero_grad()
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(wrapped.positions.grad, model.positions.grad)
