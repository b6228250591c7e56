"""Accumulating scatters at indices that never repeat become copies: ``index_add`` → ``index_copy``.

The gradient of ``x.index_select(0, idx)`` is ``index_add(zeros, 0, idx, grad)``: AOTAutograd cannot
know that ``idx`` never repeats, so it accumulates. Exported, that is an accumulating
``ScatterND``, which ortrain must run as ``ScatterElements`` (ONNX Runtime's threads lose additions
to a repeated index, ``ortrain.passes.scatter_nd_accumulation``): one element after the other,
0.6-0.8 ms for 512 x 256 values on a 2-core AMD EPYC, five of them a step in padding elimination's
backward (the real tokens' rows gathered before each layer). Where the index is
``nonzero(mask)`` of a one-dimensional mask (padding elimination's real-token positions, label
sparsity's counted rows, through views), its values are distinct by construction, and:

- adding into zeros at distinct positions is copying there: ``index_copy`` (``index_put`` without
  accumulation), a plain ``ScatterND`` that ONNX Runtime runs on all threads, correctly, since no
  two slices meet;
- adding into a tensor ``t`` that holds values (``scatter_accumulate`` folds ``t + index_add(zeros,
  ...)`` into ``index_add(t, ...)``: label sparsity's rows' gradient onto the returned logits'
  gradient) is ``index_copy(t, idx, t[idx] + src)``: the selected rows are read, added to and
  written back, in parallel, instead of ``rows x V`` serial additions.

Distinctness is read on the joint graph, before the partition, where the backward's index is still
the forward's ``nonzero`` node (after it, the backward sees an input): :func:`mark_distinct_indices`
marks those index nodes, and the mark travels with the node's ``meta`` into both graphs, where
:func:`copy_into_distinct_positions` rewrites after the other backward rewrites.
"""

from __future__ import annotations

import logging

import torch

from ortrain.capture.loss_backward import is_zeros
from ortrain.capture.view_ops import RESHAPES

logger = logging.getLogger("ortrain.capture")

aten = torch.ops.aten

DISTINCT = "ortrain_distinct_values"  # meta key: this index tensor's values never repeat

# Ops that hand their input's elements on unchanged and in order (a view of a [N, 1] nonzero as [N]).
_SAME_ELEMENTS = RESHAPES | {aten.clone.default}
_SCATTERS = (aten.index_add.default, aten.index_put.default)


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


def _index_of(node: torch.fx.Node) -> object:
    if node.target is aten.index_add.default:
        return node.args[2] if len(node.args) == 4 and node.kwargs.get("alpha", 1) == 1 else None
    indices = node.args[1]
    return indices[0] if isinstance(indices, (list, tuple)) and len(indices) == 1 else None


def mark_distinct_indices(graph: torch.fx.Graph) -> int:
    """Mark the index of each accumulating scatter whose values never repeat; returns how many."""
    marked = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _SCATTERS:
            continue
        index = _index_of(node)
        if isinstance(index, torch.fx.Node) and DISTINCT not in index.meta and has_distinct_values(index):
            index.meta[DISTINCT] = True
            marked += 1
    return marked


def _accumulates_at_distinct_positions(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _SCATTERS:
        return False
    if node.target is aten.index_put.default:
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if not accumulate:
            return False
    index = _index_of(node)
    return isinstance(index, torch.fx.Node) and bool(index.meta.get(DISTINCT))


def copy_into_distinct_positions(gm: torch.fx.GraphModule) -> int:
    """Rewrite each accumulating scatter whose index is marked distinct; returns how many."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if not _accumulates_at_distinct_positions(node):
            continue
        base = node.args[0]
        assert isinstance(base, torch.fx.Node)
        if node.target is aten.index_put.default:
            if not is_zeros(base):
                continue  # values broadcast over the selected rows: left accumulating
            node.args = (*node.args[:3], False)
            node.kwargs = {}
        elif is_zeros(base):
            node.target = aten.index_copy.default
        else:
            _, dim, index, source = node.args
            with graph.inserting_before(node):
                held = graph.call_function(aten.index_select.default, (base, dim, index))
                summed = graph.call_function(aten.add.Tensor, (held, source))
            # index_add's source has the selected rows' shape and the base's dtype
            held.meta["val"] = summed.meta["val"] = source.meta.get("val")  # type: ignore[union-attr]
            node.target, node.args = aten.index_copy.default, (base, dim, index, summed)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
        logger.debug("%d scatter(s) at distinct positions copy instead of adding", rewritten)
    return rewritten
