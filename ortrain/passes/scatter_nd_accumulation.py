"""Accumulating ``ScatterND`` (reduction add/mul/min/max) rewritten so that no update is lost.

ONNX Runtime's CPU ``ScatterND`` splits its slices among the intra-op threads also when it
accumulates, so two slices with the same index (two tokens of one id in an embedding's gradient,
which the exporter writes as ``ScatterND(zeros, ids, grad, reduction="add")``) can be added at the
same time and one addition lost (microsoft/onnxruntime#18048). Measured with onnxruntime 1.32, two
threads, ``[8, 128]`` token ids drawn from 100 values scattered into ``[8000, 256]``: 12 of 30 runs
wrong, by up to 4.6; with ids drawn from 8000 (few repeats) none. Its ``ScatterElements`` adds one
element after the other and was right in every run.

Rewritten: ``ScatterND`` with a reduction, float32 or float64 data, indices whose last dim is 1 (one
index into axis 0 per slice: embedding gradients, ``index_put(accumulate=True)`` on rows). The
updates become ``[M, *data.shape[1:]]`` rows and the index is repeated along each row, then
``ScatterElements(axis=0)`` with the same reduction adds them in order. The index tensor is
materialized at the updates' size (int64), the price of being right. Other ``ScatterND`` nodes (a
reduction of "none", whose indices the standard requires to be unique, or several index dims) stay.

A small float32 table's sums (at most ``SMALL_TABLE_ROWS`` rows: BERT's two token types, segment
embeddings, T5's 32 relative position buckets) are a product instead: ``data + OneHot(ids, V)^T @
rows``, which adds the same values (in another order) on all threads; the one-hot rows come from
comparing the ids with ``0..V-1`` (ONNX Runtime's ``OneHot`` kernel writes one element at a time:
1.19 ms for 16384 ids into 32 rows, the comparison 0.2). ``ScatterElements`` adds every update into
one of two rows one after the other: 541 µs for 1024 x 256 updates into ``[2, 256]`` against 30 µs
as a product (onnxruntime 1.32, 2-core AMD EPYC, Zen 5); 146 against 517 µs at 32 rows, 1117 against
537 at 512, where the product's work (rows x updates) has overtaken the scatter's. With finite
updates the sums are the same up to float32 rounding; an infinite or NaN update also turns the
table's other rows NaN (0 x inf in the product) where the scatter leaves them finite: a step whose
gradients eager holds an infinity in already, which a loss scaler skips and plain SGD breaks on
either way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import onnx
import onnx_ir as ir

from ortrain.passes.node_rewrites import insert_node, int64_constant, rewrite_each_node, take_over_output

logger = logging.getLogger("ortrain.passes")

_ACCUMULATING = ("add", "mul", "min", "max")
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE)
SMALL_TABLE_ROWS = 32


def _rewrite(graph: ir.Graph, node: ir.Node) -> bool:
    if node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
        return False
    reduction = node.attributes.get("reduction")
    if reduction is None or reduction.value not in _ACCUMULATING:
        return False
    data, indices, updates = node.inputs
    if data is None or indices is None or updates is None or data.dtype not in _FLOATS:
        return False
    if data.shape is None or indices.shape is None or len(indices.shape) < 1 or indices.shape[-1] != 1:
        return False
    op = functools.partial(insert_node, graph, node, node.name or "scatter_nd")
    table_rows = data.shape[0]
    # Float32 only, as measured (float64 tables keep the scatter).
    small = isinstance(table_rows, int) and table_rows <= SMALL_TABLE_ROWS
    if reduction.value == "add" and small and data.dtype == ir.DataType.FLOAT:
        result = _table_product(op, data, indices, updates, table_rows)
    else:
        result = _one_after_another(op, data, indices, updates, reduction.value)
    take_over_output(result, node.outputs[0])
    graph.remove(node, safe=True)
    return True


def _table_product(
    op: Callable[..., ir.Value], data: ir.Value, indices: ir.Value, updates: ir.Value, table_rows: int
) -> ir.Value:
    """``data + OneHot(ids)^T @ rows``, the one-hot rows by comparison."""
    ints = functools.partial(int64_constant, op)
    assert indices.shape is not None
    # [*lead, *rest] -> [M, prod(rest)]; ids [*lead, 1] -> [M]; sums [V, prod(rest)].
    rows = op("Flatten", [updates], "rows", axis=len(indices.shape) - 1)
    ids = op("Reshape", [indices, ints("flat", [-1])], "ids")
    # One-hot rows as OneHot makes them (a negative id counts from the end, one out of range is a
    # row of zeros), by a comparison with 0..V-1: ONNX Runtime's OneHot writes one element at a
    # time, 1.19 ms for 16384 ids into 32 rows (T5's relative position buckets) against 0.2.
    negative = op(
        "Cast", [op("Less", [ids, ints("zero", [0])], "is_negative")], "negative", to=ir.DataType.INT64
    )
    wrapped = op("Add", [ids, op("Mul", [negative, ints("depth", [table_rows])], "shift")], "wrapped")
    column = op("Unsqueeze", [wrapped, ints("column_axis", [1])], "column")
    matches = op("Equal", [column, ints("table_ids", list(range(table_rows)))], "matches")
    one_hot = op("Cast", [matches], "one_hot", to=ir.DataType.FLOAT)
    sums = op("Gemm", [one_hot, rows], "sums", transA=1)
    return op("Add", [data, op("Reshape", [sums, op("Shape", [data], "table_shape")], "table")], "sum")


def _one_after_another(
    op: Callable[..., ir.Value], data: ir.Value, indices: ir.Value, updates: ir.Value, reduction: str
) -> ir.Value:
    """``ScatterElements(axis=0)`` over the updates' rows, the index repeated along each row."""
    ints = functools.partial(int64_constant, op)
    assert data.shape is not None
    rank = len(data.shape)
    # updates [*indices.shape[:-1], *data.shape[1:]] -> rows [M, *data.shape[1:]]
    row_shape = op(
        "Concat",
        [ints("minus_one", [-1]), op("Shape", [data], "row_dims", start=1)],
        "rows_shape",
        axis=0,
    )
    rows = op("Reshape", [updates, row_shape], "rows")
    # indices [*lead, 1] -> [M, 1, ..., 1] -> [M, *data.shape[1:]], the same index along each row
    column = op("Reshape", [indices, ints("column_shape", [-1] + [1] * (rank - 1))], "column")
    index = op("Expand", [column, op("Shape", [rows], "rows_dims")], "index")
    return op("ScatterElements", [data, index, rows], "elements", axis=0, reduction=reduction)


def serialize_scatter_nd_accumulation(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the rewrite to every eligible ``ScatterND``; unchanged when none is."""
    model, rewritten = rewrite_each_node(model, "ScatterND", _rewrite)
    if rewritten:
        logger.debug("%d accumulating ScatterND written so that no update is lost", rewritten)
    return model
