"""``log_softmax``'s backward fused with the one-hot gradient of the loss it feeds.

A cross-entropy / NLL loss hands ``log_softmax``'s backward a gradient that is zero but for one
value a row, scattered at the target into a zeros tensor the size of the logits (see
``nll_loss_backward`` in :mod:`ortrain.capture.decompositions_losses`; ``gather``'s backward has
the same form). ``_log_softmax_backward_data(G, out)`` is ``G - exp(out) * G.sum(dim)``: as
exported, zeros, scatter, sum, exp, mul and sub are each a pass over (rows x classes), with three
or four such tensors alive at once (the peak of the tiny GPT's backward run). A row's sum of that
scattered gradient is the scattered value itself, so

    grad_logits = scatter_add(exp(out) * -s, dim, target, s)     (s: the value scattered per row)

equals it exactly (the same roundings, in another order of the same operations): ``Exp`` and one
``Mul`` by a (rows, 1) tensor, then ``ScatterElements(add)``, which ONNX Runtime runs in place. With
a dense part ``D`` added to the one-hot gradient (label smoothing), ``G = S + D`` and
``grad = scatter_add(D + exp(out) * -(s + D.sum(dim)), dim, target, s)``.

Ignored rows have ``s = 0`` (the mask is applied on the row, once); ``reduction='mean'`` with no
counted label gives zero gradients, as in eager. Half-precision inputs compute in float32 and cast
once at the end, as PyTorch's own decomposition does.

The pass runs on the backward graph after partitioning (on the joint graph the partitioner would
move ``exp(out)``, which needs no tangent, into the forward and stash it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ortrain.capture.fake_tracing import copy_before, trace_on_values

logger = logging.getLogger("ortrain.capture")

aten = torch.ops.aten

_ZEROS = frozenset({aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default})
_FILLS = frozenset({aten.full.default, aten.full_like.default, aten.new_full.default})
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _OneHot:
    """``scatter(zeros, dim, index, src)`` (one index a row) or ``scatter_add(zeros, dim, index, src)``."""

    node: torch.fx.Node
    zeros: torch.fx.Node
    index: torch.fx.Node
    src: torch.fx.Node
    one_per_row: bool  # index has size 1 along dim: a row's sum is src itself


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def is_zeros(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _ZEROS:
        return True
    if node.target in _FILLS:
        fill = node.args[2] if node.target is aten.new_full.default else node.args[1]
        return isinstance(fill, (int, float)) and fill == 0
    return False


def _one_hot(node: Any, dim: int) -> _OneHot | None:
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1 or node.kwargs:
        return None
    if node.target not in (aten.scatter.src, aten.scatter_add.default):
        return None
    zeros, scatter_dim, index, src = node.args
    value, index_value, src_value = _val(node), _val(index), _val(src)
    if not isinstance(zeros, torch.fx.Node) or not is_zeros(zeros) or value is None:
        return None
    if index_value is None or src_value is None or scatter_dim % value.dim() != dim:
        return None
    if src_value.dtype != value.dtype or tuple(src_value.shape) != tuple(index_value.shape):
        return None  # scatter reads only the index-shaped corner of a larger src
    one_per_row = isinstance(index_value.shape[dim], int) and index_value.shape[dim] == 1
    if node.target is aten.scatter.src and not one_per_row:
        return None  # duplicate targets in a row overwrite: the row sum is not src's
    return _OneHot(node, zeros, index, src, one_per_row)


def _split(grad: Any, dim: int, shape: tuple[Any, ...]) -> tuple[_OneHot, torch.fx.Node | None] | None:
    """``grad`` as a one-hot scatter, optionally plus a dense tensor of the logits' shape."""
    direct = _one_hot(grad, dim)
    if direct is not None:
        return direct, None
    if not isinstance(grad, torch.fx.Node) or grad.target is not aten.add.Tensor or len(grad.users) != 1:
        return None
    if grad.kwargs.get("alpha", 1) != 1 or len(grad.args) != 2:
        return None
    for sparse, dense in (grad.args, grad.args[::-1]):
        one_hot = _one_hot(sparse, dim)
        dense_value = _val(dense)
        if one_hot is not None and isinstance(dense_value, torch.Tensor):
            if tuple(dense_value.shape) == shape and dense_value.dtype == _val(grad).dtype:
                return one_hot, dense
    return None


def _fused(dim: int, one_per_row: bool, result_dtype: torch.dtype) -> Any:
    def fused(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        dense = rest[0] if rest else None
        if out.dtype in _LOW_PRECISION:
            out, src = out.float(), src.float()
            dense = None if dense is None else dense.float()
        row = src if one_per_row else src.sum(dim, keepdim=True)
        if dense is None:
            grad = torch.exp(out) * -row
        else:
            grad = dense + torch.exp(out) * -(row + dense.sum(dim, keepdim=True))
        return grad.scatter_add(dim, index, src).to(result_dtype)

    return fused


def _replace(
    graph: torch.fx.Graph, node: torch.fx.Node, traced: torch.fx.GraphModule, inputs: list[torch.fx.Node]
) -> None:
    result = copy_before(graph, node, traced, inputs)
    assert isinstance(result, torch.fx.Node)
    node.replace_all_uses_with(result)


def _erase_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    for node in nodes:
        if not node.users:
            graph.erase_node(node)


def fuse_log_softmax_backward(gm: torch.fx.GraphModule) -> int:
    """Rewrite each ``_log_softmax_backward_data`` of a one-hot gradient; returns how many."""
    graph = gm.graph
    fused = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten._log_softmax_backward_data.default:
            continue
        grad, out, dim, _ = node.args
        value, out_value = _val(node), _val(out)
        if not isinstance(value, torch.Tensor) or not isinstance(out_value, torch.Tensor):
            continue
        dim = dim % max(out_value.dim(), 1)
        parts = _split(grad, dim, tuple(out_value.shape))
        if parts is None:
            continue
        one_hot, dense = parts
        inputs = [out, one_hot.index, one_hot.src] + ([dense] if dense is not None else [])
        function = _fused(dim, one_hot.one_per_row, value.dtype)
        _replace(graph, node, trace_on_values(function, [_val(i) for i in inputs]), inputs)
        graph.erase_node(node)
        _erase_unused(graph, [grad] if dense is not None else [])
        _erase_unused(graph, [one_hot.node, one_hot.zeros])
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
        logger.debug("fused %d log_softmax backward(s) with their loss's one-hot gradient", fused)
    return fused
