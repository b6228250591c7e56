"""Negative indices that PyTorch refuses stay refused in ONNX Runtime.

``embedding``, ``index_select``, ``gather``, the scatters and ``index_add`` raise on a negative
index in PyTorch ("Target -1 is out of bounds", "index out of range in self"). Their ONNX
translations (``Gather``, ``GatherElements``, ``ScatterElements``) count a negative index from the
end, as NumPy does. A label of -1 that the loss was not told to ignore (``ignore_index`` left at
-100) therefore trained silently on the last class in ONNX Runtime, where eager PyTorch stops
with an error (wave 34); an embedding row -1 read the last row.

Before translation, each such index that may be negative is replaced by
``masked_fill(index, index < 0, <most negative integer>)``: out of range for every size, so ONNX
Runtime's kernel raises, and ORTModule then runs the step eagerly to raise PyTorch's own error
(:mod:`ortrain.ortmodule.eager_check`). Indices that cannot be negative (``arange``, ``nonzero``,
``argmax``, the indices of ``topk`` and ``sort``) are left as they are, as are ``aten.index``'s
(advanced indexing, where PyTorch too counts negatives from the end).
"""

from __future__ import annotations

import contextlib
import operator

import torch

aten = torch.ops.aten

# operator -> position of its index operand
_BOUNDED_INDEX = {
    aten.embedding.default: 1,
    aten.index_select.default: 2,
    aten.gather.default: 2,
    aten.scatter.src: 2,
    aten.scatter.value: 2,
    aten.scatter.reduce: 2,
    aten.scatter.value_reduce: 2,
    aten.scatter_add.default: 2,
    aten.scatter_reduce.two: 2,
    aten.index_add.default: 2,
    aten.index_copy.default: 2,
}
# losses -> positions of their target and of their ``ignore_index``, a target PyTorch lets be
# negative (-100); any other negative target it refuses ("Target -1 is out of bounds"). The
# spatial ones stay whole in the graph (wave 49's review: a -1 label in a segmentation loss read
# the last class, the loss finite, where eager raises).
_TARGETS_WITH_IGNORED_VALUE = {
    aten.nll_loss_forward.default: (1, 4),
    aten.nll_loss2d_forward.default: (1, 4),
    aten.nll_loss_backward.default: (2, 5),
    aten.nll_loss2d_backward.default: (2, 5),
}
_NON_NEGATIVE = frozenset(
    {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.nonzero.default}
    | {aten.argmax.default, aten.argmin.default}
)
# multi-output operators whose output 1 holds indices into the input
_INDICES_AT_1 = frozenset(
    {aten.topk.default, aten.sort.default, aten.sort.stable, aten.max.dim, aten.min.dim}
)
# operators that move or pick values without making new ones
_SAME_VALUES = frozenset(
    {aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim}
    | {aten.expand.default, aten.clone.default, aten.slice.Tensor, aten.select.int}
    | {aten.index_select.default, aten.permute.default, aten.t.default, aten._to_copy.default}
)


def _cannot_be_negative(node: torch.fx.Node) -> bool:
    seen = 0
    while seen < 16:  # a chain of views over a producer that makes no negative value
        seen += 1
        if node.op != "call_function":
            return False
        if node.target in _NON_NEGATIVE:
            return True
        if node.target is operator.getitem:
            source, position = node.args[0], node.args[1]
            return isinstance(source, torch.fx.Node) and source.target in _INDICES_AT_1 and position == 1
        if node.target not in _SAME_VALUES or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return False


def refuse_negative_indices(gm: torch.fx.GraphModule) -> int:
    """Guard each index operand of ``gm`` that PyTorch bounds from below; returns how many."""
    guarded: dict[tuple[torch.fx.Node, object], torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        position, ignored = _BOUNDED_INDEX.get(node.target), None
        if node.target in _TARGETS_WITH_IGNORED_VALUE:
            position, ignored_at = _TARGETS_WITH_IGNORED_VALUE[node.target]
            ignored = node.args[ignored_at] if len(node.args) > ignored_at else None
            if not isinstance(ignored, int):
                continue  # a symbolic ignore_index: left as it was
        if position is None or len(node.args) <= position:
            continue
        index = node.args[position]
        if not isinstance(index, torch.fx.Node) or _cannot_be_negative(index):
            continue
        value = index.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int64, torch.int32):
            continue
        if (index, ignored) not in guarded:
            guarded[(index, ignored)] = _guard(gm.graph, index, value, ignored)
        node.update_arg(position, guarded[(index, ignored)])
    if guarded:
        gm.graph.lint()
        gm.recompile()
    return len(guarded)


def _guard(
    graph: torch.fx.Graph, index: torch.fx.Node, value: torch.Tensor, ignored: int | None = None
) -> torch.fx.Node:
    """``index`` with each negative value (but ``ignored``) made the most negative integer."""
    lowest = torch.iinfo(value.dtype).min
    made = []
    with graph.inserting_after(index):
        negative = graph.call_function(aten.lt.Scalar, (index, 0))
    made.append(negative)
    if ignored is not None and ignored < 0:
        with graph.inserting_after(negative):
            counted = graph.call_function(aten.ne.Scalar, (index, ignored))
        with graph.inserting_after(counted):
            negative = graph.call_function(aten.logical_and.default, (made[0], counted))
        made += [counted, negative]
    with graph.inserting_after(negative):
        refused = graph.call_function(aten.masked_fill.Scalar, (index, negative, lowest))
    mode = getattr(value, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        for flags in made:
            flags.meta["val"] = torch.empty_like(value, dtype=torch.bool)
        refused.meta["val"] = torch.empty_like(value)
    return refused
