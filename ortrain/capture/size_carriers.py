"""Integer inputs of a Dynamo graph carried as the size of an empty tensor.

After a graph break on ``.tolist()`` or ``.item()``, the Python numbers flow into the next graph
as symbolic integer inputs (once Dynamo saw them change). ONNX inputs are tensors, and the
exporter derives every size symbol from an input tensor's shape; a symbol that is no tensor's
size cannot be exported. So each such input ``n`` becomes a tensor input of shape ``(0, n)``
(no elements, nothing to copy) and its uses read ``sym_size(carrier, 1)``; the runner builds the
carrier from the number at each call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

GraphRunner = Callable[[list[Any]], list[Any]]


def carry_free_sizes(gm: torch.fx.GraphModule) -> list[int]:
    """Rewrite ``gm`` in place; returns the input positions that now take a carrier tensor."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tensors = [n.meta.get("val") for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    if not tensors:
        return []
    fake_mode = getattr(tensors[0], "fake_mode", None)
    if fake_mode is None:
        return []
    known: set[Any] = set()
    for value in tensors:
        for size in value.shape:
            if isinstance(size, torch.SymInt):
                known |= size.node.expr.free_symbols
    first_computation = next((n for n in graph.nodes if n.op != "placeholder"), None)
    # Bare symbols first (``s28``), so that an expression of them (``6 - s28``) is then known.
    order = sorted(
        enumerate(placeholders),
        key=lambda item: (
            not (isinstance(v := item[1].meta.get("val"), torch.SymInt) and v.node.expr.is_Symbol)
        ),
    )
    positions = []
    for position, node in order:
        value = node.meta.get("val")
        if not isinstance(value, torch.SymInt) or value.node.expr.free_symbols <= known:
            continue
        with graph.inserting_before(node):
            carrier = graph.placeholder(f"{node.name}_size_carrier")
        with fake_mode:
            carrier.meta["val"] = torch.empty(0, value, dtype=torch.int8)
        with graph.inserting_before(first_computation):
            size = graph.call_function(torch.ops.aten.sym_size.int, (carrier, 1))
        size.meta["val"] = value
        node.replace_all_uses_with(size)
        graph.erase_node(node)
        known |= value.node.expr.free_symbols
        positions.append(position)
    positions.sort()
    if positions:
        gm.recompile()
    return positions


def with_carriers(runner: GraphRunner, positions: list[int]) -> GraphRunner:
    """A runner that takes the graph's original inputs: numbers at ``positions``."""
    if not positions:
        return runner

    def run(args: list[Any]) -> list[Any]:
        args = list(args)
        for position in positions:
            number = int(args[position])
            if number < 0:
                raise ValueError(
                    f"input {position} of an ortrain graph is the number {number}; ortrain carries integer "
                    "inputs of graphs between graph breaks as sizes, which cannot be negative"
                )
            args[position] = torch.empty(0, number, dtype=torch.int8)
        return runner(args)

    return run
