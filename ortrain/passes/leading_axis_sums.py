"""Sums over leading axes as a row of ones times the tensor: ``ReduceSum(x, [0]) = ones[1, M] @ x``.

A linear layer's bias gradient is its output gradient summed over the rows (``ReduceSum(g, [0])``
on ``[tokens, features]``), a LayerNorm's weight and bias gradients likewise. ONNX Runtime's CPU
``ReduceSum`` is slow over leading axes at some shapes: onnxruntime 1.32, 2-core AMD EPYC (Zen 5),
float32 ``[M, 256]`` summed over ``M`` took 57 µs at ``M`` = 512 and 14 µs at ``M`` = 513 (torch 6.5
µs), ``[512, 512]`` 165 µs. Padding elimination leaves about 512 real tokens in the benchmark's
8 × 128 batch, so its backward ran 45 of them, 3.5 ms a step. As a matrix-vector product through
MLAS: 8 µs and 12 µs, and faster than ``ReduceSum`` on every shape measured (``[64, 1024]`` to
``[2048, 256]``, ``[512, 8000]``: 127 against 219 µs; narrow ones too, ``[65536, 4]``: 97 against
1789 µs). The additions happen in another order:
values differ by float32 rounding (relative 1e-6 on sums of 2048 terms).

Rewritten: float32 ``ReduceSum`` whose constant axes are the leading ones (``[0]``, ``[0, 1]``;
negative axes normalized with the rank) and leave at least one axis, the trailing dimensions
static. The leading ones may be symbolic (the real-token count): the row of ones takes its length
from the input's shape. Sums over trailing axes (a row sum) are fast as they are and stay.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import onnx
import onnx_ir as ir

from ortrain.passes.node_rewrites import (
    insert_node,
    int64_constant,
    reduced_axes,
    rewrite_each_node,
    take_over_output,
)

logger = logging.getLogger("ortrain.passes")


def _leading_axes(node: ir.Node) -> int | None:
    """How many leading axes ``node`` sums over, or None when it is not such a sum."""
    data, axes = node.inputs[0], reduced_axes(node)
    if data is None or data.dtype != ir.DataType.FLOAT or data.shape is None or not axes:
        return None  # no axes: every axis, or none with noop_with_empty_axes
    if axes != list(range(len(axes))) or len(axes) == len(data.shape):
        return None
    if not all(isinstance(d, int) for d in data.shape[len(axes) :]):
        return None
    return len(axes)


def _rewrite(graph: ir.Graph, node: ir.Node) -> bool:
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx"):
        return False
    leading = _leading_axes(node)
    if leading is None:
        return False
    data = node.inputs[0]
    assert data is not None and data.shape is not None
    trailing = [int(d) for d in data.shape[leading:]]  # type: ignore[call-overload]
    columns = math.prod(trailing)
    op = functools.partial(insert_node, graph, node, node.name or "reduce_sum")
    ints = functools.partial(int64_constant, op)

    matrix = data
    if leading != 1 or len(trailing) != 1:
        matrix = op("Reshape", [data, ints("matrix_shape", [-1, columns])], "matrix")
    rows = op("Shape", [matrix], "rows", start=0, end=1)
    ones_shape = op("Concat", [ints("one", [1]), rows], "ones_shape", axis=0)
    ones = op("ConstantOfShape", [ones_shape], "ones", value=ir.tensor(np.ones(1, dtype=np.float32)))
    result = op("MatMul", [ones, matrix], "sum")  # [1, columns]
    keepdims = node.attributes.get("keepdims")
    out_shape = ([1] * leading if keepdims is None or keepdims.value else []) + trailing
    if out_shape != [1, columns]:
        result = op("Reshape", [result, ints("out_shape", out_shape)], "out")
    take_over_output(result, node.outputs[0])
    graph.remove(node, safe=True)
    return True


def sum_leading_axes_by_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the rewrite to every eligible ``ReduceSum``; unchanged when none is."""
    model, rewritten = rewrite_each_node(model, "ReduceSum", _rewrite)
    if rewritten:
        logger.debug("%d sums over leading axes written as products with a row of ones", rewritten)
    return model
