"""Integer sums written as running sums, which ONNX Runtime computes exactly.

ONNX Runtime's CPU ``ReduceSum`` (1.32) adds int64 and int32 tensors in double precision and
converts the total back, saturating: a total past 2**53 lost its last bits (``2**53 + 1`` summed
alone came back as ``2**53``), one past the type's range came back as its largest value where
PyTorch wraps. So ``x.sum(-1)`` of ``[2**62 - 1, 2**62 - 1, 12345]`` was int64's maximum, and a
rolling polynomial hash (``torch.sum(bytes * prime ** arange(n), -1) % buckets``, Meta's BLT
n-gram embeddings) put every n-gram in another bucket than eager, silently (wave 53's review).
Its ``CumSum`` and ``MatMul`` add in the integer type and wrap as PyTorch does.

Before a region is translated, each ``sum`` whose result is int64 or int32 becomes, for each
reduced dimension, a ``cumsum`` along it (in the result's dtype, as PyTorch's kernel adds) of which
the last entry is kept: the same total, wrapped the same way. A dimension that may be empty gets
a zero in front first (the sum of nothing is 0). Sums of booleans and of 8- and 16-bit integers
into int64 (``mask.sum()``, the commonest) stay ``ReduceSum``: no total of theirs reaches 2**53.
``prod`` of integers has no such form (ONNX has no running product) and saturates still (the
README's *Where ortrain still differs*).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ortrain.export.spelled_out_math import NodeBuilder, rewrite_nodes

aten = torch.ops.aten

_SUMS = frozenset({aten.sum.default, aten.sum.dim_IntList})
_WRAPPING = frozenset({torch.int64, torch.int32})
# Sources whose sums into int64 stay below 2**53 for any tensor that fits in memory.
_NARROW = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16})


def sum_integers_exactly(gm: torch.fx.GraphModule) -> int:
    """Rewrite each integer ``sum`` of ``gm`` as running sums (see the module); returns how many."""
    return rewrite_nodes(gm, _running_sums)


def _running_sums(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op != "call_function" or node.target not in _SUMS:
        return None
    source, result = node.args[0], node.meta.get("val")
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return None
    if result.dtype not in _WRAPPING or (result.dtype == torch.int64 and value.dtype in _NARROW):
        return None
    if node.target is aten.sum.default:
        dims, keepdim = None, False
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    rank = value.dim()
    reduced = sorted({d % rank for d in dims}) if dims and rank else list(range(rank))
    b = NodeBuilder(node.graph, result)
    total = source
    if value.dtype != result.dtype or rank == 0:  # a 0-d sum is its element, converted
        total = b.call(aten._to_copy.default, source, dtype=result.dtype)
    for dim in reduced:
        total = _last_running_sum(b, total, dim, value.shape[dim], rank, result.dtype)
    if not keepdim and reduced:
        total = b.call(aten.squeeze.dims, total, reduced)
    return total


def _last_running_sum(
    b: NodeBuilder, total: torch.fx.Node, dim: int, size: int | torch.SymInt, rank: int, dtype: torch.dtype
) -> torch.fx.Node:
    """``total`` summed along ``dim``, which is kept with size 1."""
    if statically_known_true(size == 1):
        return total
    if not statically_known_true(size > 0):
        # a zero in front: the last running sum of an empty dimension is then 0
        pad = [0] * (2 * (rank - 1 - dim)) + [1, 0]
        total = b.call(aten.constant_pad_nd.default, total, pad, 0)
    running = b.call(aten.cumsum.default, total, dim, dtype=dtype)
    return b.call(aten.slice.Tensor, running, dim, -1, torch.iinfo(torch.int64).max)
