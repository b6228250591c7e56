"""Label sparsity (``ORTMODULE_ENABLE_SPARSE_OPTIMIZER``): a loss that ignores labels sees counted rows only.

``cross_entropy(logits, target, ignore_index=i)`` with ``mean`` or ``sum`` reduction gives the
same value when only the rows whose target is not ``i`` are passed in: ignored rows add nothing
to the sum nor to the count. So the pass inserts, before each such loss,

    idx = nonzero(target != i).view(-1)
    loss = cross_entropy(logits.index_select(0, idx), target.index_select(0, idx), ...)

The softmax and the loss (forward and backward) then run on the counted rows; the compute
optimizer moves the gather further up (through the LM head) where nothing else reads the dense
rows. With no counted row the loss is ``nan`` for ``mean`` (0/0) and 0 for ``sum``, as in eager
PyTorch, and every gradient is zero. A loss whose labels in the captured batch nearly all count
is left dense (:mod:`ortrain.passes.label_density`).

It runs on the pre-dispatch forward graph (see :mod:`ortrain.capture.forward_rewrite`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ortrain.passes.label_density import dense_reason, sparse_enough
from ortrain.passes.rowwise import op_name, value

logger = logging.getLogger("ortrain.passes")

aten = torch.ops.aten

# Loss op -> (position of the reduction argument, its default, position of ignore_index, its default).
_LOSSES: dict[Any, tuple[int, int, int, int]] = {
    aten.cross_entropy_loss.default: (3, 1, 4, -100),
    aten.nll_loss_nd.default: (3, 1, 4, -100),
    aten.nll_loss.default: (3, 1, 4, -100),
    aten.nll_loss_forward.default: (3, 1, 4, -100),
}
_NONE, _MEAN, _SUM = 0, 1, 2


@dataclass(frozen=True)
class LabelLoss:
    """A loss over rows whose labels may be ignored."""

    node: torch.fx.Node
    logits: torch.fx.Node
    target: torch.fx.Node
    reduction: int
    ignore_index: int


def _arg(node: torch.fx.Node, position: int, name: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def label_losses(graph: torch.fx.Graph) -> list[LabelLoss]:
    """The losses in ``graph`` that take class labels with an ``ignore_index``."""
    found = []
    for node in graph.nodes:
        spec = _LOSSES.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        logits, target = node.args[0], node.args[1]
        if not isinstance(logits, torch.fx.Node) or not isinstance(target, torch.fx.Node):
            continue
        reduction = _arg(node, spec[0], "reduction", spec[1])
        ignore_index = _arg(node, spec[2], "ignore_index", spec[3])
        if isinstance(reduction, int) and isinstance(ignore_index, int):
            found.append(LabelLoss(node, logits, target, reduction, ignore_index))
    return found


def gather_counted_rows(
    graph: torch.fx.Graph, rows: torch.fx.Node, target: torch.fx.Node, ignore_index: int
) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Nodes (at the graph's insertion point) selecting the rows of ``rows`` (2-D) and of
    ``target`` (1-D) whose label is not ``ignore_index``; the two selections, in that order."""
    counted = graph.call_function(aten.ne.Scalar, (target, ignore_index))
    positions = graph.call_function(aten.nonzero.default, (counted,))
    index = graph.call_function(aten.view.default, (positions, [-1]))
    return (
        graph.call_function(aten.index_select.default, (rows, 0, index)),
        graph.call_function(aten.index_select.default, (target, 0, index)),
    )


def gather_counted_labels(gm: torch.fx.GraphModule) -> list[str]:
    """Insert the gather of counted rows before each eligible loss; one line per loss changed."""
    graph = gm.graph
    changes = []
    for loss in label_losses(graph):
        logits, target = value(loss.logits), value(loss.target)
        if logits is None or target is None or logits.dim() != 2 or target.dim() != 1:
            logger.info("label sparsity: %s left dense (logits are not [rows, classes])", loss.node.name)
            continue
        if loss.reduction not in (_MEAN, _SUM):
            logger.info("label sparsity: %s left dense (reduction='none' returns every row)", loss.node.name)
            continue
        sparse, density = sparse_enough(loss.target, loss.ignore_index)
        if not sparse:
            logger.info("label sparsity: %s left dense (%s)", loss.node.name, dense_reason(density))
            continue
        with graph.inserting_before(loss.node):
            rows, labels = gather_counted_rows(graph, loss.logits, loss.target, loss.ignore_index)
        loss.node.args = (rows, labels, *loss.node.args[2:])
        changes.append(
            f"label sparsity: {op_name(loss.node)} (ignore_index={loss.ignore_index}) "
            "now runs on the counted rows only"
        )
        logger.info("%s", changes[-1])
    return changes
