"""reduce_booleans_as_bytes: all/any of a mask reduced over uint8, the same booleans."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from _eager_parity import one_step_against_eager
from onnx import TensorProto, helper, numpy_helper

from ortrain.passes.boolean_reductions import reduce_booleans_as_bytes
from ortrain.passes.pipeline import default_passes


def _model(
    reduction: str, shape: list[int], *, to: int = TensorProto.INT64, last: int = TensorProto.BOOL
) -> onnx.ModelProto:
    """The exporter's torch.all / torch.any over the last axis: Cast, reduction, Cast."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["mask"], ["wide"], to=to),
            helper.make_node(reduction, ["wide", "axes"], ["reduced"], keepdims=0),
            helper.make_node("Cast", ["reduced"], ["out"], to=last),
        ],
        "boolean_reduction",
        [helper.make_tensor_value_info("mask", TensorProto.BOOL, shape)],
        [helper.make_tensor_value_info("out", last, None)],
        [numpy_helper.from_array(np.array([-1], np.int64), "axes")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, mask: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"mask": mask})[0]


@pytest.mark.parametrize(("reduction", "torch_op"), [("ReduceMin", torch.all), ("ReduceMax", torch.any)])
@pytest.mark.parametrize("to", [TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT])
def test_the_same_booleans(reduction: str, torch_op: object, to: int) -> None:
    model = _model(reduction, [4, 8, 32], to=to)
    rewritten = reduce_booleans_as_bytes(model)
    casts = [n for n in rewritten.graph.node if n.op_type == "Cast"]
    assert helper.get_attribute_value(casts[0].attribute[0]) == TensorProto.UINT8
    rng = np.random.default_rng(0)
    mask = rng.random((4, 8, 32)) > 0.05  # some rows all true
    mask[0] = False  # rows all false
    mask[1, :, :5] = True
    got = _run(rewritten, mask)
    np.testing.assert_array_equal(got, _run(model, mask))
    np.testing.assert_array_equal(got, torch_op(torch.from_numpy(mask), dim=-1).numpy())  # type: ignore[operator]


def test_any_over_an_empty_dimension_is_false_as_in_torch() -> None:
    model = _model("ReduceMax", [3, 0])
    mask = np.zeros((3, 0), bool)
    np.testing.assert_array_equal(_run(reduce_booleans_as_bytes(model), mask), np.zeros(3, bool))
    assert not torch.any(torch.from_numpy(mask), dim=-1).any()


def test_a_reduction_read_as_a_number_stays() -> None:
    model = _model("ReduceMin", [4, 8], last=TensorProto.FLOAT)
    assert reduce_booleans_as_bytes(model) is model


def test_a_cast_the_graph_returns_stays_beside_the_reductions_own() -> None:
    model = _model("ReduceMin", [4, 8])
    model.graph.output.append(helper.make_tensor_value_info("wide", TensorProto.INT64, [4, 8]))
    rewritten = reduce_booleans_as_bytes(model)
    casts = {
        n.output[0]: helper.get_attribute_value(n.attribute[0])
        for n in rewritten.graph.node
        if n.op_type == "Cast"
    }
    assert casts["wide"] == TensorProto.INT64 and TensorProto.UINT8 in casts.values()
    mask = np.random.default_rng(0).random((4, 8)) > 0.1
    session = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    out, wide = session.run(None, {"mask": mask})
    np.testing.assert_array_equal(out, mask.all(-1))
    np.testing.assert_array_equal(wide, mask.astype(np.int64))


def test_a_mask_cast_once_for_several_readers_reduces_an_empty_dimension_as_torch() -> None:
    """``m.any(-1)`` beside ``m.all(-1)`` and ``m.sum(-1)``: the exporter casts ``m`` once for all
    three. Until wave 41 the shared cast kept int64's maximum of nothing, and ``any`` was true."""
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["mask"], ["wide"], to=TensorProto.INT64),
            helper.make_node("ReduceMax", ["wide", "axes"], ["most"], keepdims=0),
            helper.make_node("Cast", ["most"], ["any"], to=TensorProto.BOOL),
            helper.make_node("ReduceMin", ["wide", "axes"], ["least"], keepdims=0),
            helper.make_node("Cast", ["least"], ["all"], to=TensorProto.BOOL),
            helper.make_node("ReduceSum", ["wide", "axes"], ["count"], keepdims=0),
        ],
        "shared_cast",
        [helper.make_tensor_value_info("mask", TensorProto.BOOL, [3, 0])],
        [
            helper.make_tensor_value_info("any", TensorProto.BOOL, None),
            helper.make_tensor_value_info("all", TensorProto.BOOL, None),
            helper.make_tensor_value_info("count", TensorProto.INT64, None),
        ],
        [axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(
        reduce_booleans_as_bytes(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    mask = torch.zeros(3, 0, dtype=torch.bool)
    got_any, got_all, got_count = session.run(None, {"mask": mask.numpy()})
    np.testing.assert_array_equal(got_any, mask.any(-1).numpy())  # false
    np.testing.assert_array_equal(got_all, mask.all(-1).numpy())  # true
    np.testing.assert_array_equal(got_count, mask.sum(-1).numpy())


def test_in_the_default_pipeline() -> None:
    assert "reduce_booleans_as_bytes" in [name for name, _ in default_passes(compute_optimizer=True)]


class _SafeSoftmaxAttention(torch.nn.Module):
    """Masked attention whose fully masked rows give zeros: torch.all over the scores' mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        scores = (q @ q.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        empty = torch.all(scores == float("-inf"), dim=-1, keepdim=True)
        probs = torch.where(empty, 0.0, torch.softmax(scores, dim=-1))
        return (probs @ q).pow(2).mean()


def test_a_masked_attention_trains_as_eager(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    x = torch.randn(4, 12, 16)
    allowed = torch.rand(4, 12, 12) > 0.3
    allowed[0, 3] = False  # a row with nothing to attend to
    _, graphs = one_step_against_eager(
        _SafeSoftmaxAttention, x, allowed, monkeypatch=monkeypatch, tmp_path=tmp_path
    )
    forward = graphs["forward"]
    reduced = [n for n in forward.graph.node if n.op_type == "ReduceMin"]
    assert reduced, "the exporter's torch.all is no longer a ReduceMin"
    assert {
        v.type.tensor_type.elem_type for v in forward.graph.value_info if v.name == reduced[0].input[0]
    } == {TensorProto.UINT8}
