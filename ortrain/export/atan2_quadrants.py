"""``atan2`` as PyTorch computes it, quadrant for quadrant, in ONNX Runtime.

ONNX has no ``atan2``; onnxscript translates ``aten.atan2(y, x)`` as ``atan(y / x)`` moved by π
where ``x < 0``, up if ``y > 0`` and down otherwise. That answers -π for ``atan2(0, -1)``, where
PyTorch (and C's ``atan2``) answer π: a zero ``y`` with a negative ``x`` is common, not an edge
(the phase of a real signal's DC bin, ``torch.atan2(imag, real)`` of an ``rfft``; a point on the
negative x axis), and the two answers are 2π apart. It also answers 0 for both infinite
(PyTorch: ±π/4, ±3π/4), for ``x = -0`` (π/2 turned to -π/2) and for a NaN operand (PyTorch: NaN).

Before translation, each ``atan2`` becomes the same computation spelled in operators whose
translations are exact, with the signs of zeros read as IEEE 754 and C define them (a zero's sign
is the sign of its reciprocal's infinity):

* ``slope = y / x``, or ``sign(y) * sign(x)`` where both are infinite (whose quotient is NaN),
  or ``y / 1`` where both are zero (±0, keeping ``y``'s sign, where ``y / x`` is NaN);
* ``angle = atan(slope)``;
* where ``x`` is negative or -0, ``angle ± π``, by the sign of ``y`` (-0 counts as negative).

A NaN operand stays NaN through ``atan`` and the addition. Half-precision operands are computed
in float32 and rounded once, as PyTorch's kernel does. Gradients are unaffected: AOTAutograd's
backward of ``atan2`` is ``x / (x² + y²)`` and ``-y / (x² + y²)``, already plain arithmetic.
"""

from __future__ import annotations

import math
from typing import Any

import torch

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)


def spell_out_atan2(gm: torch.fx.GraphModule) -> int:
    """Replace each ``aten.atan2`` of ``gm`` by its exact form; returns how many."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.atan2.default:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            continue
        with gm.graph.inserting_before(node):
            exact = _Builder(gm.graph, value).atan2(*node.args)
        node.replace_all_uses_with(exact)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced


class _Builder:
    """Inserts ATen nodes at the graph's insertion point, each with the fake value the export
    reads (its dtype and shape), computed by the operator itself under the graph's fake mode."""

    def __init__(self, graph: torch.fx.Graph, result: torch.Tensor) -> None:
        self.graph = graph
        self.result = result
        self.mode = getattr(result, "fake_mode", None)
        self.dtype = torch.float32 if result.dtype in _HALF else result.dtype

    def call(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fakes = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        if self.mode is None:
            node.meta["val"] = target(*fakes, **kwargs)
        else:
            with self.mode:
                node.meta["val"] = target(*fakes, **kwargs)
        return node

    def operand(self, value: Any) -> torch.fx.Node:
        if not isinstance(value, torch.fx.Node):  # a number: the graph's dtype, as a 0-d tensor
            return self.call(aten.scalar_tensor.default, float(value), dtype=self.dtype)
        if value.meta["val"].dtype != self.dtype:
            return self.call(aten._to_copy.default, value, dtype=self.dtype)
        return value

    def negative(self, t: torch.fx.Node) -> torch.fx.Node:
        """``t < 0``, -0 included."""
        signed_zero = self.call(
            aten.logical_and.default,
            self.call(aten.eq.Scalar, t, 0),
            self.call(aten.lt.Scalar, self.call(aten.reciprocal.default, t), 0),
        )
        return self.call(aten.logical_or.default, self.call(aten.lt.Scalar, t, 0), signed_zero)

    def atan2(self, y_arg: Any, x_arg: Any) -> torch.fx.Node:
        # ONNX Runtime's Where returns +0 where it picks a -0 of its *first* branch (its second
        # keeps the sign: onnxruntime 1.32, CPU), so every value that may be a signed zero
        # travels through a Where's second branch or through arithmetic.
        y, x = self.operand(y_arg), self.operand(x_arg)
        both_zero = self.call(
            aten.logical_and.default, self.call(aten.eq.Scalar, y, 0), self.call(aten.eq.Scalar, x, 0)
        )
        # both zero: y / 1 is y, its sign kept, where y / x is NaN
        divisor = self.call(aten.where.self, both_zero, self.operand(1.0), x)
        both_infinite = self.call(
            aten.logical_and.default, self.call(aten.isinf.default, y), self.call(aten.isinf.default, x)
        )
        diagonal = self.call(
            aten.mul.Tensor, self.call(aten.sign.default, y), self.call(aten.sign.default, x)
        )
        slope = self.call(aten.where.self, both_infinite, diagonal, self.call(aten.div.Tensor, y, divisor))
        angle = self.call(aten.atan.default, slope)
        half_turn = self.call(
            aten.where.self, self.negative(y), self.operand(-math.pi), self.operand(math.pi)
        )
        turned = self.call(aten.add.Tensor, angle, half_turn)
        exact = self.call(aten.where.self, self.negative(x), turned, angle)
        if self.result.dtype != self.dtype:
            exact = self.call(aten._to_copy.default, exact, dtype=self.result.dtype)
        return exact
