"""Integer inputs of a graph carried as the size of an empty tensor.

After a graph break on ``.tolist()`` or ``.item()``, the Python numbers flow into the next graph
as symbolic integer inputs (once Dynamo saw them change); a backward graph takes the sizes its
forward saved (``T``, where only ``(T - T % 2) // 2`` is a tensor's size). ONNX inputs are
tensors, and the exporter derives every size symbol from an input tensor's shape; a symbol that
is no tensor's size cannot be exported. So, in each graph the exporter translates, each such
input ``n`` becomes a tensor input of shape ``(0, n)`` (no elements, nothing to copy) and its uses
read ``sym_size(carrier, 1)``; the ONNX Runtime executor builds the carrier from the number at
each call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def carry_free_sizes(gm: torch.fx.GraphModule) -> list[int]:
    """Rewrite ``gm`` in place; returns the input positions that now take a carrier tensor."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tensors = [n.meta.get("val") for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    fake_mode = fake_mode_of(placeholders)
    if fake_mode is None:
        return []
    # The exporter reads a symbol off a tensor whose dim is that bare symbol: a dim
    # ``(s49 - 1) // 2`` does not tell ``s49``.
    known: set[Any] = set()
    for value in tensors:
        for size in value.shape:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                known.add(size.node.expr)
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
        if value.node.expr.is_Symbol:  # an expression's carrier tells only the expression
            known.add(value.node.expr)
        positions.append(position)
    positions.sort()
    if positions:
        gm.recompile()
    return positions


def fake_mode_of(placeholders: list[torch.fx.Node]) -> FakeTensorMode | None:
    """The fake mode the graph's values live in: a tensor input's, or one over the shape
    environment of its symbolic numbers (a graph whose inputs are all numbers)."""
    values = [n.meta.get("val") for n in placeholders]
    for value in values:
        if isinstance(value, torch.Tensor) and getattr(value, "fake_mode", None) is not None:
            return value.fake_mode
    for value in values:
        if (
            isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))
            and value.node.shape_env is not None
        ):
            return FakeTensorMode(shape_env=value.node.shape_env)
    return None


def carried(args: list[Any], positions: list[int]) -> list[Any]:
    """``args`` with the numbers at ``positions`` replaced by their carriers."""
    args = list(args)
    for position in positions:
        number = int(args[position])
        if number < 0:
            raise ValueError(
                f"input {position} of an ortrain graph is the number {number}; ortrain carries integer "
                "inputs of graphs as sizes, which cannot be negative"
            )
        args[position] = torch.empty(0, number, dtype=torch.int8)
    return args
