"""ATen ops that only relabel how their first argument's elements are laid out."""

from __future__ import annotations

import torch

aten = torch.ops.aten

# Same elements in the same order, another shape: a contiguous base can be viewed, never copied.
RESHAPES = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.unsqueeze.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.alias.default,
        aten.detach.default,
    }
)

# Reshapes plus reorderings and broadcasts: the output holds no element its input lacks.
RELAYOUTS = RESHAPES | {aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default}

# Views whose strides a trace recorded: a reshape is the same view where the strides allow one,
# and a copy where they do not.
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default})


def views_as_reshapes(graph: torch.fx.Graph) -> bool:
    """Turn ``graph``'s views into reshapes, in place; returns whether it had any.

    Not those to a shape holding a 0 (an empty batch or sequence), and reshapes to one become views:
    onnxscript translates ``reshape`` as ONNX's ``Reshape`` without ``allowzero``, where a 0 copies
    the input's size there (``(2, 0, 4)`` to ``[0, 4]`` asked for ``[2, 4]``, and ONNX Runtime
    refused the region: wave 48's review), and ``view`` with it. A tensor without elements takes
    any strides, so its view never needs the copy a reshape may make."""
    views = [n for n in graph.nodes if n.op == "call_function" and n.target in VIEWS]
    for node in views:
        node.target = aten.reshape.default
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.reshape.default and _holds_zero(node):
            node.target = aten.view.default
    return bool(views)


def _holds_zero(node: torch.fx.Node) -> bool:
    shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("shape", ())
    return isinstance(shape, list | tuple) and any(isinstance(n, int) and n == 0 for n in shape)
