"""export_graph on its own: what becomes an ONNX output, and what the executor rebuilds."""

from __future__ import annotations

import onnx
import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.capture.aot_capture import capture
from ortrain.export.fx_to_onnx import export_graph
from ortrain.runtime.executors.ort import OrtSessionRunner


class _SavesInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.linear(x))
        return h.sum(), h


def test_only_distinct_computed_tensors_become_onnx_outputs() -> None:
    x = torch.randn(3, 4)
    captured = capture(_SavesInputs(), [x], training=True)
    exported = export_graph(captured.forward.graph, opset_version=18)
    onnx.checker.check_model(exported.model)
    kinds = [s.kind for s in exported.outputs]
    assert "input" in kinds  # x is saved for backward: passed through, never copied
    n_onnx = sum(k == "onnx" for k in kinds)
    assert len(exported.model.graph.output) == n_onnx
    backward = export_graph(captured.backward.graph, opset_version=18)
    assert [s.kind for s in backward.outputs][-1] == "none"  # no gradient for the input x


def test_executor_reproduces_the_fx_graph() -> None:
    x = torch.randn(3, 4)
    module = _SavesInputs()
    captured = capture(module, [x], training=True)
    state = dict(module.named_parameters())
    args = [state[name] for name in captured.state_names] + [x]
    want = captured.forward.graph(*args)
    got = OrtSessionRunner(
        export_graph(captured.forward.graph, opset_version=18), device=torch.device("cpu")
    )(args)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert got[-1] is x or any(g is x for g in got)


def test_a_session_keeps_no_copy_of_the_serialized_model() -> None:
    """onnxruntime's Python session keeps the bytes it was built from, to re-create itself after a
    provider failure, a fallback ortrain turns off (wave 41: 10.4 MiB of copies on a tiny T5)."""
    captured = capture(_SavesInputs(), [torch.randn(3, 4)], training=True)
    exported = export_graph(captured.forward.graph, opset_version=18)
    runner = OrtSessionRunner(exported, device=torch.device("cpu"))
    assert runner.session is not None and getattr(runner.session, "_model_bytes", None) is None


def test_dynamic_sizes_export_once_and_run_every_size() -> None:
    module = _SavesInputs()
    captured = capture(module, [torch.randn(3, 4)], training=True, dynamic_dims={0: (0,)})
    executor = OrtSessionRunner(
        export_graph(captured.forward.graph, opset_version=18), device=torch.device("cpu")
    )
    state = dict(module.named_parameters())
    for rows in (2, 5, 11):
        args = [state[name] for name in captured.state_names] + [torch.randn(rows, 4)]
        for a, b in zip(executor(args), captured.forward.graph(*args), strict=True):
            if isinstance(b, torch.Tensor):
                torch.testing.assert_close(a, b)
            else:
                assert a == b  # a size, computed from the input's shape


def test_int32_scatter_nd_indices_are_cast_so_onnxruntime_loads_the_model() -> None:
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ortrain.export.index_dtypes import cast_indices_to_int64

    graph = helper.make_graph(
        [helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"])],
        "scatter",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("indices", TensorProto.INT32, [2, 1]),
            helper.make_tensor_value_info("updates", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = ir.serde.deserialize_model(proto)
    assert cast_indices_to_int64(model) == 1
    fixed = ir.serde.serialize_model(model)
    onnx.checker.check_model(fixed, full_check=True)
    session = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {
        "data": np.zeros(4, np.float32),
        "indices": np.array([[3], [1]], np.int32),
        "updates": np.array([5.0, 7.0], np.float32),
    }
    np.testing.assert_array_equal(session.run(None, feeds)[0], [0.0, 7.0, 0.0, 5.0])


class _UnfoldMax(nn.Module):
    """unfold's backward is a ScatterND that onnxscript builds with int32 indices."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 10))

    def forward(self) -> torch.Tensor:
        return self.weight.unfold(1, 3, 2).max(-1).values


def test_unfold_then_max_trains_like_eager() -> None:
    import copy

    from ortrain import ORTModule

    torch.manual_seed(0)
    module = _UnfoldMax()
    eager = copy.deepcopy(module)
    weights = torch.randn(2, 4)
    (ORTModule(module)() * weights).sum().backward()
    (eager() * weights).sum().backward()
    torch.testing.assert_close(module.weight.grad, eager.weight.grad)


class _RelativeBias(nn.Module):
    """A relative-position bias read with int64 head indices and int32 offsets, and a window mask
    written with them: onnxscript's index and index_put combine index tensors of both dtypes,
    which ONNX Runtime refuses ("bound to different types")."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2, 33))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        i = torch.arange(n, dtype=torch.int32)
        offsets = (i[None, :] - i[:, None]).clamp(-16, 16) + 16
        heads = torch.arange(2)[:, None, None]
        bias = self.table[heads, offsets[None]]
        window = torch.zeros(2, n, n)
        window[heads, torch.arange(n)[None, :, None], offsets[None].clamp(max=n - 1)] = 1.0
        h = self.proj(x)
        return ((h @ h.t())[None] + bias * window).softmax(-1).sum(0) @ x


def test_advanced_indexing_with_int32_and_int64_indices_runs_on_onnx_runtime(monkeypatch) -> None:
    import copy

    from ortrain import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # nothing left to PyTorch
    torch.manual_seed(0)
    eager = _RelativeBias()
    wrapped = ORTModule(copy.deepcopy(eager))
    for n in (5, 6, 7):  # the second size captures with open sizes
        x = torch.randn(n, 4)
        for m in (eager, wrapped):
            m.zero_grad()
            m(x).pow(2).sum().backward()
        torch.testing.assert_close(wrapped.table.grad, eager.table.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(wrapped.proj.weight.grad, eager.proj.weight.grad, rtol=1e-4, atol=1e-5)


class _MatrixVector(nn.Module):
    """mv's backward is mv(matrix.t(), grad), which ONNX Runtime's optimizer got wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(5, 10))
        self.vector = nn.Parameter(torch.randn(10))
        self.bias = nn.Parameter(torch.randn(5))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.mv(self.matrix, self.vector), torch.addmv(
            self.bias, self.matrix, self.vector, beta=0.5, alpha=2
        )


def test_matrix_vector_products_train_like_eager() -> None:
    import copy

    from ortrain import ORTModule

    torch.manual_seed(0)
    module = _MatrixVector()
    eager = copy.deepcopy(module)
    w1, w2 = torch.randn(5), torch.randn(5)
    a, b = ORTModule(module)()
    ((a * w1).sum() + (b * w2).sum()).backward()
    a, b = eager()
    ((a * w1).sum() + (b * w2).sum()).backward()
    for name in ("matrix", "vector", "bias"):
        torch.testing.assert_close(getattr(module, name).grad, getattr(eager, name).grad)


def _rows_and_pads(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Outputs what a padding-elimination forward saves: the kept rows (a data-dependent count),
    and a size computed from that count (``s0 - u0``, as a backward's slice bound)."""
    rows = x.index_select(0, keep.nonzero().view(-1))
    return rows * 2, rows.sum(), x.size(0) - rows.size(0)


def test_a_size_computed_from_a_data_dependent_size_is_read_off_an_output() -> None:
    x, keep = torch.randn(6, 3), torch.tensor([True, False, True, True, False, True])
    gm = make_fx(_rows_and_pads, tracing_mode="symbolic")(x, keep)
    exported = export_graph(gm, opset_version=18)
    assert exported.outputs[-1].kind == "size" and exported.output_symbol_sources
    runner = OrtSessionRunner(exported, device=torch.device("cpu"))
    for n, kept in ((6, 4), (9, 1), (5, 5)):
        x, keep = torch.randn(n, 3), torch.randperm(n) < kept
        rows, total, pads = runner([x, keep])
        torch.testing.assert_close(rows, x[keep] * 2)
        torch.testing.assert_close(total, x[keep].sum())
        assert pads == n - kept


def test_a_data_dependent_size_that_no_tensor_carries_is_computed_as_a_number() -> None:
    """No output has the row count as a dim: ONNX computes ``s0 - u0`` from the values and the
    executor returns it as a number (it was an export error, and the graph ran in PyTorch)."""

    def sums_only(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
        _, total, pads = _rows_and_pads(x, keep)
        return total, pads

    gm = make_fx(sums_only, tracing_mode="symbolic")(torch.randn(6, 3), torch.randperm(6) < 3)
    exported = export_graph(gm, opset_version=18)
    assert exported.outputs[-1].kind == "number"
    runner = OrtSessionRunner(exported, device=torch.device("cpu"))
    for n, kept in ((6, 4), (9, 1), (5, 5)):
        x, keep = torch.randn(n, 3), torch.randperm(n) < kept
        total, pads = runner([x, keep])
        torch.testing.assert_close(total, x[keep].sum())
        assert pads == n - kept and type(pads) is int


class _ScaledByItsStride(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * x.stride(0)


def test_a_stride_no_size_determines_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic capture of a forward that reads ``x.stride(0)`` of a strided input: the stride is
    a size of its own that no input shape carries. Until wave 41 the export failed in sympy ("Cannot
    convert symbols to int"), a message that named nothing."""
    from ortrain import ORTModule
    from ortrain.errors import ORTModuleONNXModelException

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    wrapped = ORTModule(_ScaledByItsStride())
    wrapped(torch.randn(3, 8)[:, ::2])
    with pytest.raises(ORTModuleONNXModelException, match=r"strides .* that no input size determines"):
        wrapped(torch.randn(5, 8)[:, ::2])


def test_a_constant_int_output_comes_back_as_that_number() -> None:
    """TorchDynamo may return a size it specialized as a plain int (Funnel's ``seq_len``): until
    wave 42 the export refused it and the whole region ran in PyTorch."""
    gm = make_fx(lambda x: (torch.tanh(x),))(torch.randn(3, 4))
    output = gm.graph.output_node()
    output.args = ((*output.args[0], 8),)
    gm.recompile()
    exported = export_graph(gm, opset_version=18)
    runner = OrtSessionRunner(exported, device=torch.device("cpu"))
    x = torch.randn(3, 4)
    result, size = runner([x])
    torch.testing.assert_close(result, torch.tanh(x))
    assert size == 8 and type(size) is int
