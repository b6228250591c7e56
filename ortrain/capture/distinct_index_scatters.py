"""Accumulating scatters into zeros at distinct indices become copies: ``index_add`` → ``index_copy``.

The gradient of ``x.index_select(0, idx)`` is ``index_add(zeros, 0, idx, grad)``: AOTAutograd cannot
know that ``idx`` never repeats, so it accumulates. Exported, that is an accumulating
``ScatterND``, which ortrain must run as ``ScatterElements`` (ONNX Runtime's threads lose additions
to a repeated index, ``ortrain.passes.scatter_nd_accumulation``): one element after the other,
0.6-0.8 ms for 512 x 256 values on a 2-core AMD EPYC, five of them a step in padding elimination's
backward (the real tokens' rows gathered before each layer). Where the index is
``nonzero(mask)`` of a one-dimensional mask (padding elimination's real-token positions, through
views), its values are distinct by construction, and adding into zeros at distinct positions is
copying there: ``index_copy`` (``index_put`` without accumulation), a plain ``ScatterND`` that
ONNX Runtime runs on all threads, correctly, since no two slices meet.

Runs on the joint graph before the partition, where the backward's index is still the forward's
``nonzero`` node (after it, the backward sees an input). Only zeros bases: ``index_add(t, ...)``
into another tensor must add.
"""

from __future__ import annotations

import logging

import torch

from ortrain.capture.loss_backward import is_zeros

logger = logging.getLogger("ortrain.capture")

aten = torch.ops.aten

# Ops that hand their input's elements on unchanged and in order (a view of a [N, 1] nonzero as [N]).
_SAME_ELEMENTS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.alias.default,
        aten.clone.default,
        aten.detach.default,
    }
)


def has_distinct_values(node: object) -> bool:
    """Whether ``node`` is the positions of ``nonzero`` over a one-dimensional tensor (through
    ops that keep its elements), hence a tensor whose values never repeat."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _SAME_ELEMENTS:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not aten.nonzero.default:
        return False
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 1


def _copy_target(node: torch.fx.Node) -> tuple[object, tuple[object, ...], dict[str, object]] | None:
    """The copying call that ``node`` equals, or None."""
    if node.op != "call_function" or node.target not in (aten.index_add.default, aten.index_put.default):
        return None
    if not isinstance(node.args[0], torch.fx.Node) or not is_zeros(node.args[0]):
        return None
    if node.target is aten.index_add.default:
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 4 or not has_distinct_values(node.args[2]):
            return None
        return aten.index_copy.default, tuple(node.args), {}
    if node.target is aten.index_put.default:
        base, indices, values, *rest = node.args
        accumulate = rest[0] if rest else node.kwargs.get("accumulate", False)
        if not accumulate or len(indices) != 1 or not has_distinct_values(indices[0]):  # type: ignore[arg-type]
            return None
        return aten.index_put.default, (base, indices, values, False), {}
    return None


def copy_into_distinct_positions(graph: torch.fx.Graph) -> int:
    """Rewrite each accumulating scatter into zeros whose index never repeats; returns how many."""
    rewritten = 0
    for node in list(graph.nodes):
        found = _copy_target(node)
        if found is None:
            continue
        node.target, node.args, node.kwargs = found  # type: ignore[assignment]
        rewritten += 1
    if rewritten:
        logger.debug("%d scatter(s) into zeros at distinct positions copy instead of adding", rewritten)
    return rewritten
