"""rewrite_loss_head_gradient: the head's gradients equal the original graph's, without the N x V
gradient of the logits; graphs where that gradient is read otherwise are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortrain.passes.loss_head_gradient import rewrite_loss_head_gradient
from ortrain.passes.pipeline import default_passes

N, V, K = 12, 10, 4


def _model(*, extra_reader: bool = False, dynamic_rows: bool = False) -> onnx.ModelProto:
    """The loss backward as exported, then ``dx = G @ W`` and ``dW = G^T @ h`` (FusedMatMul)."""
    rows: int | str = "n" if dynamic_rows else N
    nodes = [
        helper.make_node("Exp", ["logp"], ["p"], name="exp"),
        helper.make_node("Neg", ["b"], ["a"], name="neg"),
        helper.make_node("Mul", ["p", "a"], ["scaled"], name="mul"),
        helper.make_node(
            "ScatterElements", ["scaled", "idx", "b"], ["g"], name="scatter", axis=1, reduction="add"
        ),
        helper.make_node("MatMul", ["g", "w"], ["dx"], name="mm_dx"),
        helper.make_node(
            "FusedMatMul", ["g", "h"], ["dw"], name="mm_dw", domain="com.microsoft", alpha=1.0, transA=1
        ),
    ]
    outputs = [
        helper.make_tensor_value_info("dx", TensorProto.FLOAT, [rows, K]),
        helper.make_tensor_value_info("dw", TensorProto.FLOAT, [V, K]),
    ]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["g"], ["g_sum"], name="other", keepdims=0))
        outputs.append(helper.make_tensor_value_info("g_sum", TensorProto.FLOAT, []))
    graph = helper.make_graph(
        nodes,
        "loss_head",
        [
            helper.make_tensor_value_info("logp", TensorProto.FLOAT, [rows, V]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [rows, 1]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [rows, 1]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [V, K]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [rows, K]),
        ],
        outputs,
        value_info=[
            helper.make_tensor_value_info("p", TensorProto.FLOAT, [rows, V]),
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [rows, 1]),
            helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [rows, V]),
            helper.make_tensor_value_info("g", TensorProto.FLOAT, [rows, V]),
        ],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _feeds(rows: int = N) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((rows, V)).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    b = rng.standard_normal((rows, 1)).astype(np.float32)
    b[::3] = 0.0  # ignored labels scatter nothing
    idx = rng.integers(0, V, (rows, 1))
    idx[:4] = 7  # several rows with the same target: their weight-gradient rows add up
    return {
        "logp": logp,
        "b": b,
        "idx": idx,
        "w": rng.standard_normal((V, K)).astype(np.float32),
        "h": rng.standard_normal((rows, K)).astype(np.float32),
    }


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


@pytest.mark.parametrize("dynamic_rows", [False, True])
def test_same_gradients_without_the_logits_gradient(dynamic_rows: bool) -> None:
    model = _model(dynamic_rows=dynamic_rows)
    expected = _run(model, _feeds())
    rewritten = rewrite_loss_head_gradient(onnx.ModelProto.FromString(model.SerializeToString()))
    onnx.checker.check_model(rewritten)
    ops = [node.op_type for node in rewritten.graph.node]
    # Nothing of size N x V is left but the softmax itself.
    assert "Exp" in ops and "ScatterND" not in ops  # ScatterND's add races on CPU (see the pass)
    scatters = [n for n in rewritten.graph.node if n.op_type == "ScatterElements"]
    assert [helper.get_attribute_value(a) for n in scatters for a in n.attribute if a.name == "axis"] == [0]
    assert [o.name for o in rewritten.graph.output] == ["dx", "dw"]
    got = _run(rewritten, _feeds())
    for name in ("dx", "dw"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
    # The N x V product P * a and its scatter copy are gone; P feeds the two matmuls directly.
    names = {node.name for node in rewritten.graph.node}
    assert names.isdisjoint({"mul", "scatter", "mm_dx", "mm_dw"})
    assert sorted(n.op_type for n in rewritten.graph.node if "p" in n.input) == ["FusedMatMul", "MatMul"]


def test_a_logits_gradient_read_elsewhere_is_kept() -> None:
    model = _model(extra_reader=True)
    before = [node.op_type for node in model.graph.node]
    rewritten = rewrite_loss_head_gradient(model)
    assert [node.op_type for node in rewritten.graph.node] == before


def test_registered_after_the_matmul_fusion() -> None:
    names = [name for name, _ in default_passes(compute_optimizer=False)]
    assert names.index("rewrite_loss_head_gradient") > names.index("fuse_transposed_matmuls")
