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
    """Turn ``graph``'s views into reshapes, in place; returns whether it had any."""
    views = [n for n in graph.nodes if n.op == "call_function" and n.target in VIEWS]
    for node in views:
        node.target = aten.reshape.default
    return bool(views)
