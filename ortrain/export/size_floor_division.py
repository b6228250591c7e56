"""Floor divisions of sizes that stay floor divisions in ONNX.

A graph captured with a size left open computes with it in Python arithmetic: ``n // 3``, and
``-((-2 * n) // 3)`` for a ceiling (adaptive pooling's widest window, a padding to a multiple).
onnxscript translates ``operator.floordiv`` as ONNX ``Div``, which truncates toward zero: right
for the non-negative operands it assumes, wrong for a negative one (``-16 // 3``: -5, not -6).
Adaptive max pooling over a length left open then read windows one element too narrow, and its
maxima were wrong at every length but the first, silently (wave 37). Before a graph is translated
each such division becomes ``(a - a % b) // b``: ``%`` is translated as ONNX ``Mod``, whose integer
remainder has the divisor's sign as Python's does, and the division left is exact, where
truncating and flooring agree.
"""

from __future__ import annotations

import operator

import torch

from ortrain.export.spelled_out_math import call_with_value, rewrite_nodes


def exact_floor_divisions(gm: torch.fx.GraphModule) -> int:
    """Rewrite each ``operator.floordiv`` of sizes in ``gm``; returns how many."""
    return rewrite_nodes(gm, _exact_quotient)


def _exact_quotient(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op != "call_function" or node.target is not operator.floordiv:
        return None
    a, b = node.args
    if isinstance(a, int) and isinstance(b, int):
        return None
    if not isinstance(node.meta.get("val"), (int, torch.SymInt)):
        return None  # sizes are integers; ONNX's Mod of floats is another operation
    remainder = call_with_value(node.graph, operator.mod, (a, b))
    multiple = call_with_value(node.graph, operator.sub, (a, remainder))
    return call_with_value(node.graph, operator.floordiv, (multiple, b))
