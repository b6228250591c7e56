"""Graph outputs that are views of graph inputs, made by PyTorch on the real inputs.

AOTAutograd does not trust a compiled forward with an output that aliases an input: at every call
it makes that output again from the input, as a view with the size, strides and storage offset of
the tensor the compiled graph returned. ONNX Runtime returns a fresh contiguous tensor, whose
strides say nothing about the input's memory: Longformer's overlapping chunks
(``x.as_strided(size, stride)`` at a graph break, strides ``[20, 2, 1, 1]``) came back with
``[36, 4, 1, 1]`` and the view read past the input's storage ("setStorage: ... out of bounds"),
once a second sequence length made the sizes symbolic.

Such an output is a chain of view operators from a placeholder; it costs nothing to make in
PyTorch, on the inputs of the call, which gives AOTAutograd the view it expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node


def _is_view(node: Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.is_view
        and bool(node.args)
        and isinstance(node.args[0], Node)
    )


def input_view_chains(graph: torch.fx.Graph) -> dict[int, list[Node]]:
    """For each output position that is views of one input: the nodes that make it, in graph order
    (the views, and the size arithmetic their arguments come from)."""
    placeholders = {n for n in graph.nodes if n.op == "placeholder"}
    order = {n: i for i, n in enumerate(graph.nodes)}
    output = graph.output_node()
    results = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    chains: dict[int, list[Node]] = {}
    for position, node in enumerate(results):
        chain: list[Node] = []
        while isinstance(node, Node) and _is_view(node):
            chain.append(node)
            node = node.args[0]
        if not chain or not isinstance(node, Node) or node not in placeholders:
            continue
        needed = _with_size_arithmetic(chain, placeholders)
        if needed is not None:
            chains[position] = sorted(needed, key=order.__getitem__)
    return chains


_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _with_size_arithmetic(chain: list[Node], placeholders: set[Node]) -> set[Node] | None:
    """The chain and the scalar computations its arguments read (``x.stride(1) // 2``), back to
    the inputs; None where it reads another tensor the graph computes."""
    needed: set[Node] = set()
    todo = list(chain)
    while todo:
        node = todo.pop()
        if node in needed or node in placeholders:
            continue
        if node not in chain and not isinstance(node.meta.get("val"), _SCALARS):
            return None
        if node.op != "call_function":
            return None
        needed.add(node)
        torch.fx.node.map_arg((node.args, node.kwargs), todo.append)
    return needed


def make_views(
    chains: dict[int, list[Node]], graph: torch.fx.Graph, args: Sequence[Any], outputs: list[Any]
) -> None:
    """Replace ``outputs[i]`` by its chain of views evaluated on ``args`` (the graph's inputs)."""
    if not chains:
        return
    inputs = {n: args[i] for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    for position, nodes in chains.items():
        values = dict(inputs)
        for node in nodes:
            call_args = torch.fx.node.map_arg(node.args, values.__getitem__)
            call_kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            values[node] = node.target(*call_args, **call_kwargs)  # type: ignore[operator]
        outputs[position] = values[nodes[-1]]
