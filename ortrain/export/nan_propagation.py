"""Maxima and minima that propagate NaN, as PyTorch's do.

PyTorch's max and min reductions are NaN wherever what they reduce holds a NaN (``amax``,
``amin``, ``max()``, ``min()``, the values of ``max(dim)`` / ``min(dim)``, the infinity norms),
and their indices point at the first NaN (``argmax``, ``argmin``, the indices of ``max(dim)``). ONNX Runtime's
``ReduceMax``, ``ReduceMin``, ``ArgMax`` and ``ArgMin`` (1.32, CPU) skip NaN: a row
``[1, NaN, 3]`` had the maximum 3 at index 2 where PyTorch answers NaN at index 1 (wave 37). A
model whose activations turned NaN (an overflow, a diverging run) went on with finite numbers
from such a reduction where eager PyTorch shows the NaN, and a check that reduces to find them
(``x.abs().max()`` against a threshold) saw none.

Before a region is translated, each such node is followed by a choice on whether the elements it
reduced hold a NaN (the maximum of ``isnan(x)`` over the same dimensions): NaN for the values, the
first NaN's position (the argmax of ``isnan(x)``) for the indices. Three more passes over the
reduced tensor; none of the benchmarks' models reduces this way (their softmaxes and losses are
``Softmax`` / ``LogSoftmax``, which propagate NaN). Max pooling likewise, through the same
pooling of ``isnan(x)``: one more pooling pass. ``cummax``, ``aminmax`` and adaptive max pooling,
which ortrain decomposes into these, follow (``median``'s decomposition handles NaN itself:
``capture/decompositions_math.py``).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from ortrain.export.spelled_out_math import NodeBuilder

aten = torch.ops.aten

# value reductions: (x, dims=[] (all), keepdim=False) -> values
_VALUES = {aten.amax.default, aten.amin.default}
# whole-tensor reductions to a 0-d tensor: (x) -> value
_WHOLE = {aten.max.default, aten.min.default}
# indices: (x, dim=None, keepdim=False) -> int64
_INDICES = {aten.argmax.default, aten.argmin.default}
# (x, dim, keepdim=False) -> (values, indices)
_BOTH = {aten.max.dim, aten.min.dim}
# (x, ord, dim=None, keepdim=False): the infinity norms are a ReduceMax / ReduceMin of |x|
_NORM = aten.linalg_vector_norm.default
# (x, kernel, stride, padding, dilation, ceil_mode) -> (values, indices)
_POOLS = {aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default}
_TARGETS = frozenset({*_VALUES, *_WHOLE, *_INDICES, *_BOTH, _NORM, *_POOLS})


def propagate_nan(gm: torch.fx.GraphModule) -> int:
    """Make each max/min reduction of floats in ``gm`` propagate NaN; returns how many."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _TARGETS:
            continue
        order = node.kwargs.get("ord", node.args[1] if len(node.args) > 1 else 2)
        if node.target is _NORM and abs(float(order)) != math.inf:
            continue  # the other norms are sums, which carry NaN along
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            continue
        if isinstance(value.numel(), int) and value.numel() == 0:
            continue  # nothing reduced, nothing to propagate
        if value.dim() == 0:  # ONNX has no axis 0 to reduce the NaN mask over
            continue  # a 0-d "reduction" is its element, at index 0: a NaN stays NaN
        users = list(node.users)
        with gm.graph.inserting_before(node.next):  # in order, after the node
            b = NodeBuilder(gm.graph, value)
            if node.target in _POOLS:
                spatial = 2 if node.target is aten.max_pool2d_with_indices.default else 3
                weights = _nan_positions(b, source, list(value.shape[-spatial:]))
                pooled = b.call(node.target, weights, *node.args[1:], **node.kwargs)
                has_nan = b.call(aten.gt.Scalar, b.call(operator.getitem, pooled, 0), 0)
                _replace_pair(gm, node, users, b, has_nan, b.call(operator.getitem, pooled, 1))
            else:
                _reduction_propagating_nan(gm, node, users, b, source, value)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _reduction_propagating_nan(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    users: list[torch.fx.Node],
    b: NodeBuilder,
    source: torch.fx.Node,
    value: torch.Tensor,
) -> None:
    """A reduction (values, indices or both) followed by the choice on whether what it reduced
    holds a NaN: the maximum of ``isnan(x)`` over the same dimensions."""
    nan_mask = b.call(aten._to_copy.default, b.call(aten.isnan.default, source), dtype=value.dtype)
    dims, keepdim = _reduced_dims(node, value.dim())
    has_nan = b.call(aten.gt.Scalar, b.call(aten.amax.default, nan_mask, dims, keepdim), 0)
    if node.target in _BOTH:
        first_nan = b.call(aten.argmax.default, nan_mask, dims[0], keepdim)
        _replace_pair(gm, node, users, b, has_nan, first_nan)
    elif node.target in _INDICES:
        first_nan = b.call(aten.argmax.default, nan_mask, *node.args[1:3])
        _redirect(node, users, b.call(aten.where.self, has_nan, first_nan, node))
    else:
        nan = b.call(aten.scalar_tensor.default, math.nan, dtype=value.dtype)
        _redirect(node, users, b.call(aten.where.self, has_nan, nan, node))


def _nan_positions(b: NodeBuilder, source: torch.fx.Node, plane: list[Any]) -> torch.fx.Node:
    """The tensor whose max pooling points at each window's last NaN in row-major order, as
    PyTorch's kernel does (it takes every NaN it meets): each NaN's position in its plane, plus
    one; 0 elsewhere. In float32, where positions are exact up to 2**24; in a float64 graph in
    float64, which keeps the graph all float64 (one float32 node made the export round the whole
    graph's Python numbers to float32: a float64 bilinear upsampling before an adaptive max
    pooling was 1.5e-6 off eager, wave 44)."""
    dtype = torch.float64 if source.meta["val"].dtype == torch.float64 else torch.float32
    nan_mask = b.call(aten._to_copy.default, b.call(aten.isnan.default, source), dtype=dtype)
    if not all(isinstance(size, int) for size in plane):
        return nan_mask  # a size left open: the first NaN's index, not the last's
    positions = b.call(aten.arange.start, 1, 1 + math.prod(plane), dtype=dtype)
    return b.call(aten.mul.Tensor, nan_mask, b.call(aten.view.default, positions, plane))


def _reduced_dims(node: torch.fx.Node, rank: int) -> tuple[list[int], bool]:
    """The dimensions ``node`` reduces (all of them for a whole reduction) and its keepdim."""
    args = [*node.args, None, None][:3]
    if node.target is _NORM:  # (x, ord, dim, keepdim)
        args = [node.args[0], *[*node.args[2:], None, None][:2]]
    if node.target in _WHOLE:
        return list(range(rank)), False
    dim = node.kwargs.get("dim", args[1])
    keepdim = bool(node.kwargs.get("keepdim", args[2] or False))
    if dim is None or dim == []:
        return list(range(rank)), keepdim
    return ([dim] if isinstance(dim, int) else list(dim)), keepdim


def _redirect(node: torch.fx.Node, users: list[torch.fx.Node], replacement: torch.fx.Node) -> None:
    for user in users:
        user.replace_input_with(node, replacement)


def _replace_pair(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    users: list[torch.fx.Node],
    b: NodeBuilder,
    has_nan: torch.fx.Node,
    first_nan: torch.fx.Node,
) -> None:
    """A (values, indices) node: its values NaN and its indices ``first_nan`` where a NaN is."""
    values = b.call(operator.getitem, node, 0)
    indices = b.call(operator.getitem, node, 1)
    nan = b.call(aten.scalar_tensor.default, math.nan, dtype=values.meta["val"].dtype)
    fixed = (
        b.call(aten.where.self, has_nan, nan, values),
        b.call(aten.where.self, has_nan, first_nan, indices),
    )
    for user in users:  # the getitems of the node's outputs
        if user.target is operator.getitem and isinstance(user.args[1], int):
            user.replace_all_uses_with(fixed[user.args[1]])
            gm.graph.erase_node(user)
