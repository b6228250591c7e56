"""Number inputs of a graph passed to ONNX Runtime as 0-d tensors.

A backward graph takes what its forward saved, numbers included: ``w = min(1.0, step.item() / 3)``
scales an output, and the backward reads ``w`` (a SymFloat), or a count from ``.item()`` that may
be negative or zero (an unbacked SymInt). ONNX inputs are tensors, and neither can travel as a
size (:mod:`ortrain.capture.size_carriers`). Each such input becomes a 0-d tensor input whose uses
read ``_local_scalar_dense`` of it (what ``.item()`` records), and the runner wraps the number at
each call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._sympy import functions as sympy_functions

from ortrain.capture.size_carriers import fake_mode_of

_DTYPES = {torch.SymFloat: torch.float64, torch.SymBool: torch.bool, torch.SymInt: torch.int64}


# Float arithmetic inside an integer size: ``TruncToInt(1.5 * ToFloat(2 * (s0 // 4)))``, the size
# interpolation by a scale factor gives a pooled image. No tensor holds it, ONNX Runtime would
# compute it in float32 (PyTorch computed it in float64), and the export refused it ("cannot
# express size"), which sent the backward graph to PyTorch (wave 44): it is passed as a number.
_FLOAT_ARITHMETIC = (
    sympy_functions.ToFloat,
    sympy_functions.TruncToInt,
    sympy_functions.FloatTrueDiv,
    sympy_functions.FloorToInt,
    sympy_functions.CeilToInt,
    sympy_functions.RoundToInt,
    sympy_functions.IntTrueDiv,
    sympy_functions.FloatPow,
)


def _is_number_input(value: Any) -> bool:
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return True
    if not isinstance(value, torch.SymInt):
        return False
    return bool(free_unbacked_symbols(value)) or value.node.expr.has(*_FLOAT_ARITHMETIC)


def numbers_as_tensors(gm: torch.fx.GraphModule) -> dict[int, torch.dtype]:
    """Rewrite ``gm`` in place; returns the input positions that now take a 0-d tensor, and its dtype."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fake_mode = fake_mode_of(placeholders)
    first_computation = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if fake_mode is None or first_computation is None:
        return {}
    positions: dict[int, torch.dtype] = {}
    for position, node in enumerate(placeholders):
        value = node.meta.get("val")
        if not _is_number_input(value):
            continue
        dtype = _DTYPES[type(value)]
        with graph.inserting_before(node):
            tensor = graph.placeholder(f"{node.name}_tensor")
        with fake_mode:
            tensor.meta["val"] = torch.empty((), dtype=dtype)
        with graph.inserting_before(first_computation):
            number = graph.call_function(torch.ops.aten._local_scalar_dense.default, (tensor,))
        number.meta["val"] = value
        node.replace_all_uses_with(number)
        graph.erase_node(node)
        positions[position] = dtype
    if positions:
        gm.recompile()
    return positions


def as_tensors(args: list[Any], positions: dict[int, torch.dtype]) -> list[Any]:
    """``args`` with the numbers at ``positions`` wrapped as 0-d tensors."""
    args = list(args)
    for position, dtype in positions.items():
        args[position] = torch.tensor(args[position], dtype=dtype)
    return args
