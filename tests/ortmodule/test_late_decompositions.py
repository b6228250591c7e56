"""Convolution backward, training-mode batch norm and SiLU's backward: one node each in the captured
graphs (PyTorch runs its fused kernels there), decomposed for ONNX Runtime when a region is exported."""

from __future__ import annotations

import copy

import pytest
import torch
from _parity import assert_same_state, runs_whole_in_onnxruntime, train_side_by_side
from torch import nn

from ortrain import ORTModule
from ortrain.capture.late_decompositions import LATE_OPS
from ortrain.export.fx_to_onnx import export_graph


class _ConvNet(nn.Module):
    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2) if transposed else nn.Conv2d(8, 4, 1)
        self.norm1d = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(nn.functional.silu(self.norm(self.conv(x))))
        return self.norm1d(h.mean((2, 3))).square().mean()


def _targets(graph: torch.fx.GraphModule) -> set[object]:
    return {n.target for n in graph.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "conv-transposed"])
def test_kept_whole_in_the_graphs_and_decomposed_for_onnxruntime(transposed: bool) -> None:
    torch.manual_seed(0)
    model = _ConvNet(transposed)
    batches = [torch.randn(4, 3, 9, 9) for _ in range(3)]
    _, _, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x), lr=0.1)
    assert_same_state(wrapped, eager, atol=1e-4)  # running statistics included
    ((entry,),) = list(wrapped._ortrain_graphs.values())
    forward, backward = entry.capture.forward, entry.capture.backward
    assert backward is not None
    assert _targets(forward.graph) & LATE_OPS == {torch.ops.aten._native_batch_norm_legit_functional.default}
    assert _targets(backward.graph) >= {
        torch.ops.aten.convolution_backward.default,
        torch.ops.aten.native_batch_norm_backward.default,
        torch.ops.aten.silu_backward.default,
    }
    # op tuning is off in the tests: ONNX Runtime ran both graphs, from their decomposed exports.
    assert runs_whole_in_onnxruntime(forward.runner) and runs_whole_in_onnxruntime(backward.runner)
    # onnxscript would translate the forward's batch norm in inference mode: it is decomposed first.
    exported = export_graph(forward.graph, opset_version=18)
    assert "BatchNormalization" not in {node.op_type for node in exported.model.graph.node}


class _SpecialFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.tensor([0.3, 1.0, 2.0, 3.7, 7.5]))

    def forward(self) -> torch.Tensor:
        x = self.x
        terms = (torch.lgamma(x), torch.digamma(x), torch.i0(x), torch.special.i1e(x))
        return sum(terms, torch.erfinv(torch.tanh(x)) + torch.special.erfcx(x)).sum()


@pytest.mark.parametrize("placement", ["all-torch", "onnxruntime"])
def test_special_functions_run_as_pytorchs_kernels_outside_onnxruntime(
    placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wave 35: the series written for ONNX replaced PyTorch's kernels in every capture, so the
    all-torch placement gave lgamma(2) = 9.5e-7 (PyTorch: 0). Now the graphs keep the operators:
    PyTorch's placement gives eager's numbers exactly, ONNX Runtime's runs the series."""
    from ortrain.ortmodule import ortmodule as ortmodule_module
    from ortrain.runtime.graph_executor import build_graph_executor
    from ortrain.runtime.placement import Placement

    def placed(graph, *, name, settings, **options):  # type: ignore[no-untyped-def]
        return build_graph_executor(graph, name=name, placement=Placement.from_name(placement), **options)

    monkeypatch.setattr(ortmodule_module, "build_tuned_graph_executor", placed)
    model = _SpecialFunctions()
    wrapped = ORTModule(copy.deepcopy(model))
    got, expected = wrapped(), model()
    got.backward()
    expected.backward()
    ((entry,),) = list(wrapped._ortrain_graphs.values())
    assert {torch.ops.aten.lgamma.default, torch.ops.aten.i0.default} <= _targets(entry.capture.forward.graph)
    assert torch.ops.aten.polygamma.default in _targets(entry.capture.backward.graph)  # digamma'
    if placement == "all-torch":
        assert torch.equal(got, expected)
        assert torch.equal(wrapped.module.x.grad, model.x.grad)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wrapped.module.x.grad, model.x.grad, rtol=1e-5, atol=1e-5)


class _StridedConvolutions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.down = nn.Conv2d(8, 16, 1, stride=2)  # a 1x1 downsample: no padding, a skipped tail
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.stem(x)))
        return self.head(h.mean((2, 3))).square().mean()


def test_a_strided_convolution_keeps_the_batch_size_open_in_onnxruntime(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The input gradient's decomposition, traced at export on the capture's fake values, padded
    with a kernel that read the sizes as integers: the batch size became the example's, each new
    batch captured again, and op tuning's deferred export failed in ONNX Runtime at a later size
    (wave 43, a ResNet at its sixth step)."""
    import logging

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = _StridedConvolutions()
    wrapped = ORTModule(copy.deepcopy(model))
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for batch, size in [(4, 16), (3, 20), (5, 24), (2, 17)]:
            x = torch.randn(batch, 3, size, size)
            losses = [m(x) for m in (model, wrapped)]
            for loss in losses:
                loss.backward()
            torch.testing.assert_close(losses[1], losses[0])
            torch.testing.assert_close(wrapped.stem.weight.grad, model.stem.weight.grad, rtol=1e-4, atol=1e-5)
    assert caplog.text.count("capturing a graph:") == 2  # the first sizes, then all of them open


class _UpToTheSkip(nn.Module):
    """A U-Net's level: down by a strided convolution, up to the skip connection's size."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up(torch.relu(self.down(x)), output_size=x.shape[-2:])
        return (up * x).square().mean()


def test_a_transposed_convolution_to_an_open_output_size_runs_in_onnxruntime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its output padding follows the image size (odd or even): ONNX holds it as a fixed
    attribute, and the export at open sizes failed, so the forward ran in PyTorch (an error under
    FALLBACK_DISABLE; wave 50's review)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = _UpToTheSkip()
    wrapped = ORTModule(copy.deepcopy(model))
    for height, width in [(8, 8), (12, 12), (9, 9), (11, 7), (10, 13)]:
        x = torch.randn(2, 2, height, width)
        losses = [m(x) for m in (model, wrapped)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0])
        for name in ("down", "up"):
            for p, q in zip(
                getattr(wrapped, name).parameters(), getattr(model, name).parameters(), strict=True
            ):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    for entries in wrapped._ortrain_graphs.values():
        for entry in entries:
            assert runs_whole_in_onnxruntime(entry.capture.forward.runner)


def test_a_float64_batch_norm_in_eval_keeps_its_epsilon_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    # ONNX's BatchNormalization holds epsilon as a float32 attribute: 1e-3 was 0.0010000000475,
    # 2e-8 relative off eager at small running variances (wave 47's review); a model in eval()
    # that still trains got gradients as far off.
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # ONNX Runtime runs the graphs
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16, eps=1e-3)).double()
    with torch.no_grad():
        eager[1].running_var.uniform_(1e-4, 2e-4)
    eager.eval()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(8, 6, dtype=torch.float64) * 0.01
    expected, got = eager(x), wrapped(x)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
    expected.pow(2).sum().backward()
    got.pow(2).sum().backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, rtol=1e-12, atol=0)


class _FillsTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).t()  # not contiguous
        filled = h.index_fill(1, index, 0.0)
        reduced = h.index_reduce(1, index, torch.tanh(h[:, : index.numel()]), "amax", include_self=False)
        return (filled * torch.arange(filled.numel()).view_as(filled)).sum() + reduced.sum()


def test_index_fill_of_a_non_contiguous_tensor_runs_in_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 47's review: PyTorch's reference index_fill keeps the strides with prims.copy_strided,
    which has no ONNX translation: refused under FALLBACK_DISABLE (this folder's conftest)."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    eager = _FillsTransposed().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    x, index = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 3])
    expected, got = eager(x, index), wrapped(x, index)
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, msg=name)


class _BroadcastsToNodes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.node, self.graph = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, batch: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        h = self.node(x)
        pooled = self.graph(torch.zeros(counts.shape[0], 4, dtype=x.dtype).index_add(0, batch, h))
        return (h * torch.repeat_interleave(pooled, counts, dim=0, output_size=x.shape[0])).sum()


def test_repeat_interleave_with_an_output_size_runs_in_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 47's review: onnxscript refused the output_size hint, which sent the region around it
    to PyTorch (FALLBACK_DISABLE, this folder's conftest: refused)."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    eager = _BroadcastsToNodes()
    wrapped = ORTModule(copy.deepcopy(eager))
    for counts in ([2, 3], [1, 4, 2], [3, 3]):
        counts = torch.tensor(counts)
        batch = torch.repeat_interleave(torch.arange(len(counts)), counts)
        x = torch.randn(int(counts.sum()), 4)
        for model in (eager, wrapped):
            model.zero_grad()
            model(x, batch, counts).backward()
        for name, p in eager.named_parameters():
            torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, msg=name)


class _MixedOperands(nn.Module):
    """Tabular features: int columns stacked with float ones, an int count raised to a learned power."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.power = nn.Parameter(torch.tensor(0.5))

    def forward(self, counts: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        h = torch.stack([counts[:, 0], values[:, 0], counts[:, 1], values[:, 1]], 1)
        damped = torch.pow(counts, self.power) + counts ** values[0, 0]
        return (self.linear(h).squeeze(1) * damped.sum(1)).square().mean()


def test_stack_and_pow_of_int_and_float_operands_run_in_onnxruntime() -> None:
    """Wave 48's review: PyTorch promotes their operands, torch.onnx's type promotion did not, and
    ONNX Runtime refused the region (the model ran in PyTorch, an error under FALLBACK_DISABLE)."""
    torch.manual_seed(0)
    batches = [(torch.randint(1, 5, (n, 2)), torch.rand(n, 2) + 0.5) for n in (6, 6, 6)]
    _, _, eager, wrapped = train_side_by_side(_MixedOperands(), batches, lambda m, b: m(*b))
    assert_same_state(wrapped, eager, atol=1e-5)
    for group in wrapped._ortrain_graphs.values():
        for entry in group:
            assert runs_whole_in_onnxruntime(entry.capture.forward.runner)
            assert runs_whole_in_onnxruntime(entry.capture.backward.runner)
