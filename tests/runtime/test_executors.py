"""Each executor alone on hand-made FX graphs, the executor choice per device, and a graph that
mixes python ops, torch-only ops and ONNX Runtime regions."""

from __future__ import annotations

import logging

import onnxruntime as ort
import pytest
import torch

from ortrain.capture.aot_capture import capture
from ortrain.errors import FallbackPolicy, ORTModuleDeviceException
from ortrain.runtime.executors.base import RegionRejected
from ortrain.runtime.executors.ort import OnnxRuntimeExecutor, OrtSessionRunner, missing_kernels
from ortrain.runtime.executors.torch import TorchExecutor
from ortrain.runtime.graph_executor import build_graph_executor
from ortrain.runtime.selection import select_executors

aten = torch.ops.aten


def _graph(dtype: torch.dtype = torch.float32) -> torch.fx.GraphModule:
    """x @ w + b, then relu and a sum: hand-made, with the fake values export needs."""
    graph = torch.fx.Graph()
    x, w, b = (graph.placeholder(n) for n in ("x", "w", "b"))
    mm = graph.call_function(aten.mm.default, (x, w))
    add = graph.call_function(aten.add.Tensor, (mm, b))
    relu = graph.call_function(aten.relu.default, (add,))
    total = graph.call_function(aten.sum.default, (relu,))
    graph.output((relu, total))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(torch.empty(s, dtype=dtype)) for s in ((4, 3), (3, 5), (5,))]
        for node, fake in zip(gm.graph.nodes, fakes, strict=False):
            node.meta["val"] = fake
        for node in list(gm.graph.nodes)[3:-1]:
            args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]
            node.meta["val"] = node.target(*args)
    return gm


def _args(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(4, 3).to(dtype), torch.randn(3, 5).to(dtype), torch.randn(5).to(dtype)]


def _ort(**kwargs) -> OnnxRuntimeExecutor:
    return OnnxRuntimeExecutor(
        device=torch.device("cpu"),
        provider="CPUExecutionProvider",
        opset_version=18,
        passes=[],
        graph_name="g",
        **kwargs,
    )


def test_torch_executor_runs_any_region_as_pytorch_does() -> None:
    gm = _graph()
    run = TorchExecutor().build(gm, what="g", whole=True)
    for got, want in zip(run(_args()), gm(*_args()), strict=True):
        torch.testing.assert_close(got, want)


def _normalized_across_features(x, weight, bias, mean, var):
    """PatchTST's BatchNorm over the feature dimension of (batch, length, features), flattened."""
    out = aten._native_batch_norm_legit_functional.default(
        x.transpose(1, 2), weight, bias, mean, var, True, 0.1, 1e-5
    )[0]
    return (out.transpose(1, 2).view(-1, x.shape[2]),)


def test_torch_executor_runs_a_graph_whose_kernels_return_other_strides_than_traced() -> None:
    """The fake kernel of batch norm keeps a transposed input's strides, the CPU kernel returns
    a contiguous output: the traced view that transposes it back failed on the real tensor (as the
    function itself fails when it runs eagerly: eager PyTorch's `F.batch_norm` is the reference)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    args = [torch.randn(6, 4, 16), torch.ones(16), torch.zeros(16), torch.zeros(16), torch.ones(16)]
    gm = make_fx(_normalized_across_features, tracing_mode="fake")(*args)
    assert aten.view.default in {n.target for n in gm.graph.nodes}
    for whole in (True, False):
        run = TorchExecutor().build(gm, what="g", whole=whole)
        (got,) = run([a.clone() for a in args])
        x, weight, bias, mean, var = (a.clone() for a in args)
        want = torch.nn.functional.batch_norm(x.transpose(1, 2), mean, var, weight, bias, training=True)
        torch.testing.assert_close(got, want.transpose(1, 2).reshape(-1, 16))


def test_ort_executor_runs_a_float32_region_in_one_session() -> None:
    gm = _graph()
    executor = _ort()
    assert all(executor.claims(n) for n in gm.graph.nodes if n.op == "call_function")
    run = executor.build(gm, what="g", whole=True)
    assert isinstance(run, OrtSessionRunner) and run.session is not None
    for got, want in zip(run(_args()), gm(*_args()), strict=True):
        torch.testing.assert_close(got, want)


def test_ort_sessions_run_nodes_in_the_graphs_own_order() -> None:
    # ONNX Runtime's default order ran the weight-gradient products last (backward memory).
    run = _ort().build(_graph(), what="g", whole=True)
    assert isinstance(run, OrtSessionRunner) and run.session is not None
    assert run.session.get_session_options().execution_order == ort.ExecutionOrder.PRIORITY_BASED


def test_ort_sessions_keep_slices_of_one_tensor_apart(tmp_path) -> None:
    # ONNX Runtime's GatherSliceToSplitFusion writes every slice at once as one Split: the fused
    # loss's per-chunk slices of returned logits became a second full copy alive for the loop.
    import onnx
    from onnx import TensorProto, helper

    from ortrain.runtime.executors.ort import DISABLED_OPTIMIZERS, session_options

    def bound(name: str, value: int) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value_ints=[value])

    nodes = [bound("zero", 0), bound("one", 1), bound("two", 2), bound("axis", 0)]
    for i, (start, end) in enumerate((("zero", "one"), ("one", "two"))):
        nodes += [
            helper.make_node("Slice", ["x", start, end, "axis"], [f"chunk{i}"]),
            helper.make_node("Exp", [f"chunk{i}"], [f"exp{i}"]),
            helper.make_node("ReduceSum", [f"exp{i}"], [f"sum{i}"], keepdims=0),
        ]
    nodes.append(helper.make_node("Add", ["sum0", "sum1"], ["total"]))
    graph = helper.make_graph(
        nodes,
        "chunks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(
        model.SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=DISABLED_OPTIMIZERS,
    )
    x = torch.randn(2, 8)
    (total,) = session.run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.as_tensor(total), x.exp().sum())
    ops = [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]
    assert ops.count("Slice") == 2 and "Split" not in ops, ops


def test_ort_executor_rejects_the_nodes_without_a_bfloat16_kernel() -> None:
    with pytest.raises(RegionRejected) as rejected:
        _ort().build(_graph(torch.bfloat16), what="g", whole=True)
    # Each ONNX node without a kernel is traced back to its FX node, even where torch.onnx's
    # re-trace renamed the nodes (mm_default -> mm).
    reasons = rejected.value.reasons
    assert "no MatMul kernel for bfloat16" in reasons["mm_default"]
    assert "no Relu kernel for bfloat16" in reasons["relu_default"]


def test_ort_executor_binds_bfloat16_by_pointer() -> None:
    # A bfloat16 region made of ops the CPU provider has bfloat16 kernels for (transpose, concat).
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    t = graph.call_function(aten.t.default, (x,))
    cat = graph.call_function(aten.cat.default, ([t, t], 0))
    graph.output((cat,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x.meta["val"] = mode.from_tensor(torch.empty(2, 3, dtype=torch.bfloat16))
        t.meta["val"] = x.meta["val"].t()
        cat.meta["val"] = torch.cat([t.meta["val"], t.meta["val"]])
    value = torch.randn(2, 3).to(torch.bfloat16)
    (got,) = _ort().build(gm, what="g", whole=True)([value])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.cat([value.t(), value.t()]))


def test_kernel_check_reads_the_type_constraints() -> None:
    import onnx
    from onnx import TensorProto, helper

    def model(element_type: int) -> onnx.ModelProto:
        node = helper.make_node("Gemm", ["a", "b"], ["c"], name="gemm")
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info(n, element_type, [2, 2]) for n in ("a", "b")],
            [helper.make_tensor_value_info("c", element_type, [2, 2])],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    assert missing_kernels(model(TensorProto.FLOAT), "CPUExecutionProvider") == []
    ((node, why),) = missing_kernels(model(TensorProto.BFLOAT16), "CPUExecutionProvider")
    assert node.name == "gemm" and "bfloat16" in why


def test_kernel_check_refuses_scatter_reductions_the_cpu_kernel_rejects_when_it_runs() -> None:
    """ScatterND has a bfloat16 CPU kernel, which fails at run time when it must add: a bfloat16
    embedding backward passed the check, loaded, then raised at its first run."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def model(element_type: int, reduction: str) -> onnx.ModelProto:
        node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], name="scatter")
        if reduction != "none":
            node.attribute.append(helper.make_attribute("reduction", reduction))
        graph = helper.make_graph(
            [node],
            "g",
            [
                helper.make_tensor_value_info("data", element_type, [3, 2]),
                helper.make_tensor_value_info("indices", TensorProto.INT64, [2, 1]),
                helper.make_tensor_value_info("updates", element_type, [2, 2]),
            ],
            [helper.make_tensor_value_info("out", element_type, [3, 2])],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    ((node, why),) = missing_kernels(model(TensorProto.BFLOAT16, "add"), "CPUExecutionProvider")
    assert node.name == "scatter" and why.endswith("ScatterND reduction=add kernel for bfloat16")
    assert missing_kernels(model(TensorProto.BFLOAT16, "none"), "CPUExecutionProvider") == []
    assert missing_kernels(model(TensorProto.FLOAT, "add"), "CPUExecutionProvider") == []
    # What the check stands for: the session loads, and the run fails.
    session = ort.InferenceSession(
        model(TensorProto.BFLOAT16, "add").SerializeToString(), providers=["CPUExecutionProvider"]
    )
    feeds = {
        "data": torch.zeros(3, 2, dtype=torch.bfloat16),
        "indices": torch.tensor([[0], [2]]),
        "updates": torch.ones(2, 2, dtype=torch.bfloat16),
    }
    binding = session.io_binding()
    for name, tensor in feeds.items():
        element_type = TensorProto.BFLOAT16 if tensor.dtype == torch.bfloat16 else TensorProto.INT64
        binding.bind_input(name, "cpu", 0, element_type, tuple(tensor.shape), tensor.data_ptr())
    binding.bind_output("out", "cpu", 0)
    with pytest.raises(Exception, match="BFloat16 data type is not supported"):
        session.run_with_iobinding(binding)


def test_kernel_check_accepts_function_ops_that_onnxruntime_inlines() -> None:
    """HardSwish and Mish have no CPU kernel but an ONNX function body, which ONNX Runtime
    inlines: they were refused ("no HardSwish-18 kernel"), failing nn.Hardswish under
    FALLBACK_DISABLE."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    for op in ("HardSwish", "Mish"):
        graph = helper.make_graph(
            [helper.make_node(op, ["x"], ["y"], name="f")],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        )
        model: onnx.ModelProto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        assert missing_kernels(model, "CPUExecutionProvider") == []
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.array([-4.0, -1.0, 0.5, 3.5], dtype=np.float32)
        reference = torch.nn.functional.hardswish if op == "HardSwish" else torch.nn.functional.mish
        want = reference(torch.from_numpy(x))
        np.testing.assert_allclose(session.run(None, {"x": x})[0], want.numpy(), rtol=1e-6, atol=1e-6)


def test_cuda_uses_the_cuda_provider_when_onnxruntime_has_it() -> None:
    selection = select_executors(
        torch.device("cuda", 1),
        opset_version=18,
        passes=[],
        graph_name="forward",
        available_providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    assert selection.no_onnxruntime is None
    names = [e.name for e in selection.executors]
    assert names == ["python op", "onnxruntime", "torch"]
    ort_executor = selection.executors[1]
    assert ort_executor.provider == "CUDAExecutionProvider" and ort_executor.device == torch.device("cuda", 1)


def test_cuda_without_onnxruntime_gpu_runs_in_pytorch_with_one_warning(caplog) -> None:
    selection = select_executors(
        torch.device("cuda"),
        opset_version=18,
        passes=[],
        graph_name="forward",
        available_providers=["CPUExecutionProvider"],
    )
    assert [e.name for e in selection.executors] == ["python op", "torch"]
    assert "onnxruntime-gpu" in selection.no_onnxruntime
    # The same selection, on a graph: everything runs in the torch executor after one warning.
    gm = _graph()
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(2):
            runner = build_graph_executor(
                gm, name="forward", opset_version=18, passes=[], saver=None, device=torch.device("cuda"),
                available_providers=["CPUExecutionProvider"],
            )  # fmt: skip
    assert [s.executor.name for s in runner.plan.steps] == ["torch"]
    assert sum("onnxruntime-gpu" in r.getMessage() for r in caplog.records) == 1
    for got, want in zip(runner(_args()), gm(*_args()), strict=True):
        torch.testing.assert_close(got, want)
    with pytest.raises(ORTModuleDeviceException, match="onnxruntime-gpu"):
        build_graph_executor(
            gm, name="forward", opset_version=18, passes=[], saver=None, device=torch.device("cuda"),
            policy=FallbackPolicy.FALLBACK_DISABLE, available_providers=["CPUExecutionProvider"],
        )  # fmt: skip


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 3

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 3


class _Mixed(torch.nn.Module):
    """ONNX region, python op, torch-only op (segment_reduce has no ONNX translation), ONNX region."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        h = _Scale.apply(torch.tanh(self.first(x)))
        lengths = torch.tensor([1, 2], device=x.device)
        sums = torch.segment_reduce(h.abs() + 1, "sum", lengths=lengths, axis=0)
        return (self.second(sums.sum(0) * h).sum(),)


def test_a_graph_mixing_python_ops_torch_ops_and_onnx_regions() -> None:
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(3, 4)
    captured = capture(model, [x], training=True)
    runners = {}
    for name, slot in (("forward", captured.forward), ("backward", captured.backward)):
        runners[name] = slot.runner = build_graph_executor(
            slot.graph, name=name, opset_version=18, passes=[], saver=None, device=torch.device("cpu")
        )
    steps = [s.executor.name for s in runners["forward"].plan.steps]
    # segment_reduce's input (abs, add) runs in ONNX Runtime after the python op; it alone in PyTorch.
    assert steps == ["onnxruntime", "python op", "onnxruntime", "torch", "onnxruntime"]
    assert {s.executor.name for s in runners["backward"].plan.steps} == {"onnxruntime", "python op", "torch"}
    state = [*model.parameters()]
    (loss,) = captured(state, [x])
    loss.backward()
    got = [p.grad.clone() for p in state]
    model.zero_grad()
    (want,) = model(x)
    want.backward()
    torch.testing.assert_close(loss, want)
    for a, b in zip(got, (p.grad for p in state), strict=True):
        torch.testing.assert_close(a, b)


def test_a_refusal_is_learned_only_for_nodes_that_see_the_missing_types() -> None:
    from ortrain.runtime.executors.ort import _sees_types_of

    gm = torch.fx.symbolic_trace(lambda c, x: torch.where(c, x, x))
    fake = {"c": torch.zeros(2, dtype=torch.bool), "x": torch.zeros(2)}
    for node in gm.graph.nodes:
        node.meta["val"] = fake.get(node.name, torch.zeros(2))
    (where,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    # A float32 Where blamed for a bfloat16 Where's missing kernel must not be learned.
    assert not _sees_types_of(where, "CPUExecutionProvider has no Where kernel for bfloat16/bool")
    assert _sees_types_of(where, "CPUExecutionProvider has no Where kernel for bool/float")
    assert _sees_types_of(where, "CPUExecutionProvider has no Foo-18 kernel")


def test_onnxruntime_sessions_take_pytorchs_thread_count() -> None:
    from ortrain.runtime.executors.ort import session_options

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        options = session_options()
        assert options.intra_op_num_threads == 1
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    finally:
        torch.set_num_threads(before)


def test_a_reason_no_operator_could_be_blamed_for_is_said_once_with_its_region() -> None:
    """Until wave 42 such a reason was repeated for every operator of the region (166 entries, 4 kB,
    most blaming the wrong operator)."""
    from ortrain.runtime.executors.ort import UNTRACED
    from ortrain.runtime.graph_executor import _refusal_message

    untraced = "CPUExecutionProvider has no Sub kernel for bfloat16" + UNTRACED
    refused = {
        "mm": ("aten.mm.default", "CPUExecutionProvider has no MatMul kernel for bfloat16"),
        "view": ("aten.view.default", untraced),
        "view_1": ("aten.view.default", untraced),
        "get": ("getitem", untraced),
    }
    message = _refusal_message("forward", refused, disabled=True)
    assert "aten.mm.default (CPUExecutionProvider has no MatMul kernel for bfloat16)" in message
    assert message.count("no Sub kernel") == 1
    assert "in the translation of one of these, not told which: aten.view.default x2, getitem" in message


def test_a_reason_several_operators_share_is_said_once_with_them() -> None:
    """A region ONNX Runtime could not load gave each of its operators the loader's whole message
    (wave 48's review: 25 times, several kB in one warning)."""
    from ortrain.runtime.graph_executor import _refusal_message

    load = "ONNX Runtime could not load its region (Fail: Type parameter (T) of Optype (Concat) ...)"
    refused = {
        "mm": ("aten.mm.default", "CPUExecutionProvider has no MatMul kernel for bfloat16"),
        "mul": ("aten.mul.Tensor", load),
        "mul_1": ("aten.mul.Tensor", load),
        "stack": ("aten.stack.default", load),
    }
    message = _refusal_message("forward", refused, disabled=False)
    assert message.count("Optype (Concat)") == 1
    assert f"aten.mul.Tensor x2, aten.stack.default ({load})" in message
    assert "aten.mm.default (CPUExecutionProvider has no MatMul kernel for bfloat16)" in message


def test_a_refusal_learned_for_a_transposed_convolution_is_not_taken_for_a_plain_one() -> None:
    """``aten.convolution`` is ``Conv`` or, transposed, ``ConvTranspose``: the refusals learned at a
    build were keyed by operator and dtypes alone, so one was reported (and decided) for the other
    (wave 50's review: a float64 GAN's warning named ConvTranspose for both)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def convolutions(x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor) -> tuple[torch.Tensor]:
        y = torch.ops.aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        return (torch.ops.aten.convolution(y, wt, None, [2, 2], [0, 0], [1, 1], True, [0, 0], 1),)

    args = (torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), torch.randn(3, 2, 2, 2))
    gm = make_fx(convolutions, tracing_mode="fake")(*(a.double() for a in args))
    with pytest.raises(RegionRejected) as rejected:
        _ort().build(gm, what="g", whole=True)
    plain, transposed = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    assert rejected.value.reasons[plain.name].endswith("no Conv kernel for double")
    assert rejected.value.reasons[transposed.name].endswith("no ConvTranspose kernel for double")
    fresh = _ort()  # what a later graph's placement reads: the refusals learned by node kind
    assert fresh.refusal(plain).endswith("no Conv kernel for double")
    assert fresh.refusal(transposed).endswith("no ConvTranspose kernel for double")
