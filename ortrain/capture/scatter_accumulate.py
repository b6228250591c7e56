"""A tensor added to an accumulating scatter into zeros becomes the scatter's base.

``T + index_add(zeros, dim, index, src)`` is ``index_add(T, dim, index, src)`` (likewise
``scatter_add``): the scatter adds each value onto ``T`` instead of onto 0. In a backward graph
this is the logits' gradient of a model that returns its logits while label sparsity computes the
loss on the counted rows only: the rows' gradient is scattered back into a zeros tensor the size of
the logits, then AOTAutograd's gradient for the returned logits (a zeros tensor too, when the
training step reads the loss only) is added. As exported, ``ConstantOfShape`` and ``Add`` were two
(batch x seq) x vocab tensors and two passes; folded, ONNX Runtime's ``ScatterND`` copies the
gradient once and adds the rows in place. Only accumulating scatters qualify: a plain ``scatter``
overwrites, so ``T + scatter(zeros, ...)`` is not ``scatter(T, ...)``.
"""

from __future__ import annotations

import logging

import torch

from ortrain.capture.loss_backward import is_zeros

logger = logging.getLogger("ortrain.capture")

aten = torch.ops.aten

_ACCUMULATING = frozenset({aten.index_add.default, aten.scatter_add.default})
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_SIZED_ZEROS = frozenset({aten.new_zeros.default, aten.zeros.default})


def _scatter_below(node: object) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(scatter, zeros)`` when ``node`` is a single-use chain of views over an accumulating
    scatter into a zeros tensor whose size is written out (so the addend can be viewed to it)."""
    while isinstance(node, torch.fx.Node) and node.target in _VIEWS and len(node.users) == 1:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target not in _ACCUMULATING or len(node.users) != 1:
        return None
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 4:
        return None
    zeros = node.args[0]
    if not isinstance(zeros, torch.fx.Node) or not is_zeros(zeros) or len(zeros.users) != 1:
        return None
    if zeros.target not in _SIZED_ZEROS:
        return None
    return node, zeros


def fold_additions_into_scatters(gm: torch.fx.GraphModule) -> int:
    """Rewrite each ``T + (views of) accumulating_scatter(zeros, ...)``; returns how many."""
    graph = gm.graph
    folded = 0
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor or len(node.args) != 2:
            continue
        if node.kwargs.get("alpha", 1) != 1:
            continue
        value = node.meta.get("val")
        for addend, chain in (node.args, node.args[::-1]):
            found = _scatter_below(chain)
            addend_value = addend.meta.get("val") if isinstance(addend, torch.fx.Node) else None
            if (
                found is None
                or not isinstance(addend_value, torch.Tensor)
                or not isinstance(value, torch.Tensor)
            ):
                continue
            if addend_value.shape != value.shape or addend_value.dtype != value.dtype:
                continue  # a broadcast addend: the scatter's base would have another shape
            scatter, zeros = found
            chain_value = chain.meta.get("val")  # type: ignore[union-attr]
            if not isinstance(chain_value, torch.Tensor) or chain_value.shape != value.shape:
                continue
            if chain_value.dtype != value.dtype or position[addend] > position[scatter]:
                continue  # the scatter would read the addend before it is computed
            size = zeros.args[1] if zeros.target is aten.new_zeros.default else zeros.args[0]
            base_value = scatter.args[0].meta.get("val")  # type: ignore[union-attr]
            with graph.inserting_before(scatter):
                base = graph.call_function(aten.view.default, (addend, size))
            base.meta["val"] = addend_value.view(base_value.shape)
            scatter.update_arg(0, base)
            graph.erase_node(zeros)
            node.replace_all_uses_with(chain)  # type: ignore[arg-type]
            graph.erase_node(node)
            folded += 1
            break
    if folded:
        graph.lint()
        gm.recompile()
        logger.debug("folded %d addition(s) into accumulating scatters", folded)
    return folded
