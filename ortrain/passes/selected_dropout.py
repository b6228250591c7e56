"""Dropout on selected rows that draws eager's mask.

When a row selection moves up past a dropout (:mod:`ortrain.passes.rowwise`: a classifier reading
the first token), running the dropout on the selected rows only draws a smaller mask: other
numbers than eager's for those rows, and every later draw of the step shifted, so a model with
dropout could not be held to eager's losses (ViT, DistilBERT and BERT classifiers: losses off by
5e-3 to 1e-2 at the first step). The generator fills a mask in memory order, so the rows' own mask is
found only in the full one.

So the mask is drawn as eager draws it: the dropout of a tensor of ones with the dense input's
rows and features, at the dense dropout's place in the graph (the order of draws is kept too),
and the selected rows are multiplied by the selected rows of that mask. The products and
reductions that the selection saves still run on the selected rows; what remains dense is one
draw and one multiplication by one, as cheap as eager's dropout itself.

Only where eager's draw order is the contiguous one (the dense input is contiguous) and the
feature size is static; elsewhere the dropout runs on the selected rows as before.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def draws_a_mask(node: torch.fx.Node) -> bool:
    """An ``aten.dropout`` that drops something: training mode and a non-zero rate."""
    if node.target is not aten.dropout.default or len(node.args) < 3:
        return False
    rate, train = node.args[1], node.args[2]
    return train is not False and not (isinstance(rate, (int, float)) and rate == 0)


def mask_drawable(dropout: torch.fx.Node) -> bool:
    """Whether :func:`eager_mask` can draw ``dropout``'s mask as eager does: its dense input is
    contiguous (eager fills the mask in memory order) with a static feature size."""
    dense = dropout.args[0]
    value = dense.meta.get("val") if isinstance(dense, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and isinstance(value.shape[-1], int) and _contiguous(value)


def draws_randomly(node: torch.fx.Node) -> bool:
    """A node that draws from the generator (a dropout, ``rand``, ``bernoulli``...)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return draws_a_mask(node) or torch.Tag.nondeterministic_seeded in node.target.tags


def eager_mask(graph: torch.fx.Graph, dropout: torch.fx.Node, rows: torch.fx.Node) -> torch.fx.Node | None:
    """The mask (scaled by ``1 / (1 - p)``) that eager's ``dropout`` draws for its dense input,
    inserted before ``dropout``; ``rows`` is a dense value with the same rows, computed earlier.
    None where it cannot be drawn as eager draws it."""
    dense = dropout.args[0]
    dense_val = dense.meta.get("val") if isinstance(dense, torch.fx.Node) else None
    rows_val = rows.meta.get("val")
    if not isinstance(dense_val, torch.Tensor) or not isinstance(rows_val, torch.Tensor):
        return None
    features = dense_val.shape[-1]
    if not isinstance(features, int) or not _contiguous(dense_val):
        return None
    last = rows_val.dim() - 1
    with graph.inserting_before(dropout):
        # Ones with the rows of ``rows`` and the dropout's features, laid out contiguously: the
        # same elements in the same memory order as the dense input, whatever its leading shape.
        column = graph.call_function(aten.slice.Tensor, (rows, last, 0, 1))
        widened = graph.call_function(aten.expand.default, (column, [-1] * last + [features]))
        ones = graph.call_function(
            aten.ones_like.default,
            (widened,),
            {"dtype": dense_val.dtype, "memory_format": torch.contiguous_format},
        )
        mask = graph.call_function(aten.dropout.default, (ones, *dropout.args[1:]), dict(dropout.kwargs))
    mask.meta["val"] = rows_val.new_empty([*rows_val.shape[:-1], features], dtype=dense_val.dtype)
    return mask


def _contiguous(value: torch.Tensor) -> bool:
    try:
        return bool(value.is_contiguous())
    except Exception:  # a symbolic stride it cannot decide: draw on the selected rows as before
        return False
