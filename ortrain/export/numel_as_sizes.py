"""``sym_numel(t)`` in a traced decomposition, written as the product of ``t``'s sizes.

PyTorch's decompositions of some backwards read ``grad.numel()`` (``binary_cross_entropy_backward``
for its mean, ``sigmoid_backward`` through it), which a trace over a size the graph leaves open
records as ``aten.sym_numel``: torch.onnx has no translation for it, so until wave 42 such a
backward (a BCE loss computed inside the model, trained on changing batch sizes) ran in PyTorch,
and ``FALLBACK_DISABLE`` refused it. ``sym_size`` of each dimension, multiplied, has one.
"""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten


def numel_as_sizes(gm: torch.fx.GraphModule) -> int:
    """Rewrite each ``sym_numel`` node of ``gm`` (see the module); returns how many."""
    graph = gm.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.sym_numel.default:
            continue
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        with graph.inserting_before(node):
            product: torch.fx.Node | int = 1
            for dim, size in enumerate(value.shape):
                if isinstance(size, int):
                    factor: torch.fx.Node | int = size
                else:
                    factor = graph.call_function(aten.sym_size.int, (source, dim))
                    factor.meta["val"] = size
                if isinstance(product, int) and isinstance(factor, int):
                    product *= factor
                elif isinstance(product, int) and product == 1:
                    product = factor
                else:
                    left = product
                    product = graph.call_function(operator.mul, (left, factor))
                    product.meta["val"] = _value(left) * _value(factor)
        node.replace_all_uses_with(product)  # type: ignore[arg-type]
        graph.erase_node(node)
        replaced += 1
    if replaced:
        graph.lint()
        gm.recompile()
    return replaced


def _value(term: torch.fx.Node | int) -> object:
    return term.meta["val"] if isinstance(term, torch.fx.Node) else term
