"""serialize_scatter_nd_accumulation: an accumulating ScatterND with repeated indices adds every
update (ONNX Runtime's multi-threaded ScatterND can lose some); other ScatterNDs are kept."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortrain.passes.pipeline import default_passes
from ortrain.passes.scatter_nd_accumulation import serialize_scatter_nd_accumulation

V, K, B, S = 64, 256, 8, 128  # the size of an embedding gradient, big enough for several threads


def _model(
    reduction: str,
    index_dims: int = 1,
    *,
    symbolic: bool = False,
    table_rows: int = V,
    dtype: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    batch: int | str = "b" if symbolic else B
    graph = helper.make_graph(
        [
            helper.make_node(
                "ScatterND", ["data", "ids", "grad"], ["out"], name="scatter", reduction=reduction
            )
        ],
        "embedding_backward",
        [
            helper.make_tensor_value_info("data", dtype, [table_rows, K]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, S, index_dims]),
            helper.make_tensor_value_info("grad", dtype, [batch, S] + [K] * (2 - index_dims)),
        ],
        [helper.make_tensor_value_info("out", dtype, [table_rows, K])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize(("reduction", "symbolic"), [("add", False), ("add", True), ("max", False)])
def test_repeated_ids_all_accumulate(reduction: str, symbolic: bool) -> None:
    rewritten = serialize_scatter_nd_accumulation(_model(reduction, symbolic=symbolic))
    onnx.checker.check_model(rewritten)
    assert [n.op_type for n in rewritten.graph.node if n.op_type.startswith("Scatter")] == ["ScatterElements"]
    assert [o.name for o in rewritten.graph.output] == ["out"]
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = rng.integers(0, 10, (B, S, 1))  # few distinct ids: the original lost updates in most runs
        grad = rng.standard_normal((B, S, K)).astype(np.float32)
        data = np.zeros((V, K), dtype=np.float32)  # as an embedding gradient starts
        expected = data.astype(np.float64)
        rows, updates = ids.reshape(-1) % V, grad.reshape(-1, K)
        if reduction == "add":
            np.add.at(expected, rows, updates)
        else:
            np.maximum.at(expected, rows, updates)
        got = _run(rewritten, {"data": data, "ids": ids, "grad": grad})
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("table_rows", "batch"), [(2, B), (32, B), (2, 3), (2, 0)])
def test_a_small_tables_sums_are_a_product_with_the_same_values(table_rows: int, batch: int) -> None:
    rewritten = serialize_scatter_nd_accumulation(_model("add", symbolic=True, table_rows=table_rows))
    onnx.checker.check_model(rewritten)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Equal" in ops and "Gemm" in ops and not any(op.startswith("Scatter") for op in ops)
    rng = np.random.default_rng(0)
    # BERT's token types: every id repeats; a negative id counts from the end, as in ScatterND.
    ids = rng.integers(-table_rows, table_rows, (batch, S, 1))
    grad = rng.standard_normal((batch, S, K)).astype(np.float32)
    data = rng.standard_normal((table_rows, K)).astype(np.float32)  # a table that holds values: added to
    expected = data.astype(np.float64)
    np.add.at(expected, ids.reshape(-1) % table_rows, grad.reshape(-1, K))
    got = _run(rewritten, {"data": data, "ids": ids, "grad": grad})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_a_small_tables_other_reductions_and_a_larger_table_stay_serial() -> None:
    double = _model("add", table_rows=2, dtype=TensorProto.DOUBLE)  # float32 products only
    for model in (_model("max", table_rows=2), _model("add", table_rows=33), double):
        ops = [n.op_type for n in serialize_scatter_nd_accumulation(model).graph.node]
        assert "ScatterElements" in ops and "Gemm" not in ops


def test_unique_index_scatters_and_several_index_dims_are_kept() -> None:
    for model in (_model("none"), _model("add", index_dims=2)):
        before = [n.op_type for n in model.graph.node]
        assert [n.op_type for n in serialize_scatter_nd_accumulation(model).graph.node] == before


def test_an_untyped_intermediate_scatter_is_rewritten_and_serializes() -> None:
    """A ScatterND feeding another node has no value_info: the rewrite must not invent a type."""
    model = _model("add")
    model.graph.node[0].output[0] = "scattered"
    model.graph.node.append(helper.make_node("Identity", ["scattered"], ["out"]))
    rewritten = serialize_scatter_nd_accumulation(model)
    onnx.checker.check_model(rewritten)
    ids = np.array([[[1]] * S] * B)
    grad = np.ones((B, S, K), dtype=np.float32)
    got = _run(rewritten, {"data": np.zeros((V, K), dtype=np.float32), "ids": ids, "grad": grad})
    np.testing.assert_array_equal(got[1], np.full(K, B * S, dtype=np.float32))


def test_in_the_default_pipeline() -> None:
    assert "serialize_scatter_nd_accumulation" in [name for name, _ in default_passes(compute_optimizer=True)]
