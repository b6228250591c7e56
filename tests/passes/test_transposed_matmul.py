"""fuse_transposed_matmuls: same outputs, the fused node at the MatMul's place, ineligible pairs kept."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortrain.passes.pipeline import default_passes
from ortrain.passes.transposed_matmul import fuse_transposed_matmuls


def _model(a_shape: list[int], b_shape: list[int], perm: list[int], *, trans_on: str) -> onnx.ModelProto:
    """``Relu(MatMul(Transpose(a), b))`` (or with ``b`` transposed), shapes in value_info as exported."""
    transposed_shape = [(a_shape if trans_on == "a" else b_shape)[p] for p in perm]
    a_in, b_in = ("a_t", "b") if trans_on == "a" else ("a", "b_t")
    left = transposed_shape if trans_on == "a" else a_shape
    right = b_shape if trans_on == "a" else transposed_shape
    out_shape = [*left[:-1], right[-1]]
    nodes = [
        helper.make_node("Transpose", [trans_on], [f"{trans_on}_t"], perm=perm, name="transpose"),
        helper.make_node("MatMul", [a_in, b_in], ["mm"], name="matmul"),
        helper.make_node("Relu", ["mm"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        value_info=[
            helper.make_tensor_value_info(f"{trans_on}_t", TensorProto.FLOAT, transposed_shape),
            helper.make_tensor_value_info("mm", TensorProto.FLOAT, out_shape),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "perm", "trans_on"),
    [
        ([6, 4], [6, 5], [1, 0], "a"),  # a weight gradient: grad^T @ input
        ([4, 6], [5, 6], [1, 0], "b"),
        ([2, 3, 4, 6], [2, 3, 5, 6], [0, 1, 3, 2], "b"),  # attention scores: q @ k^T
        ([2, 3, 6, 4], [2, 3, 6, 5], [0, 1, 3, 2], "a"),
    ],
)
def test_fused_in_place_with_equal_outputs(
    a_shape: list[int], b_shape: list[int], perm: list[int], trans_on: str
) -> None:
    model = _model(a_shape, b_shape, perm, trans_on=trans_on)
    rng = np.random.default_rng(0)
    shapes = {"a": a_shape, "b": b_shape}
    feeds = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    expected = _run(model, feeds)
    fused = fuse_transposed_matmuls(onnx.ModelProto.FromString(model.SerializeToString()))
    assert [n.op_type for n in fused.graph.node] == ["FusedMatMul", "Relu"]
    attributes = {a.name: helper.get_attribute_value(a) for a in fused.graph.node[0].attribute}
    assert (attributes["transA"], attributes["transB"]) == ((1, 0) if trans_on == "a" else (0, 1))
    np.testing.assert_allclose(_run(fused, feeds), expected, rtol=1e-5, atol=1e-5)


def test_other_permutations_and_shared_transposes_are_kept() -> None:
    # A transpose that moves a leading dim is no matmul transpose.
    moved = _model([2, 3, 4, 6], [3, 2, 6, 5], [1, 0, 2, 3], trans_on="a")
    assert [n.op_type for n in fuse_transposed_matmuls(moved).graph.node] == ["Transpose", "MatMul", "Relu"]
    # A transposed operand read again elsewhere must stay.
    shared = _model([6, 4], [6, 5], [1, 0], trans_on="a")
    shared.graph.node.append(helper.make_node("Relu", ["a_t"], ["z"], name="other"))
    shared.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 6]))
    assert [n.op_type for n in fuse_transposed_matmuls(shared).graph.node][:2] == ["Transpose", "MatMul"]


def test_in_the_default_pipeline() -> None:
    assert ("fuse_transposed_matmuls", fuse_transposed_matmuls) in default_passes(compute_optimizer=False)
