"""Math operators whose ONNX translations lose PyTorch's answers, spelled out exactly.

Before a region is translated for ONNX Runtime, each of these nodes becomes the computation
PyTorch's CPU kernel does, written in operators whose translations are exact. Gradients are
unaffected: AOTAutograd's backward formulas are separate nodes, already plain arithmetic.
Half-precision operands are computed in float32 and rounded once, as PyTorch's kernels do.

``atan2(y, x)``: ONNX has none; onnxscript writes ``atan(y / x)`` moved by π where ``x < 0``, up
if ``y > 0`` and down otherwise. That answers -π for ``atan2(0, -1)``, where PyTorch (and C's
``atan2``) answer π: a zero ``y`` with a negative ``x`` is common, not an edge (the phase of a real
signal's DC bin, a point on the negative x axis), and the two answers are 2π apart. It also
answered 0 for both infinite (PyTorch: ±π/4, ±3π/4), for ``x = -0`` (π/2 turned to -π/2) and for a
NaN operand (PyTorch: NaN). Spelled out with the signs of zeros read as IEEE 754 and C define them
(a zero's sign is the sign of its reciprocal's infinity): ``slope = y / x``, or ``sign(y) *
sign(x)`` where both are infinite, or ``y / 1`` where both are zero (keeping ``y``'s sign); then
``atan(slope)``, moved by ±π by the sign of ``y`` where ``x`` is negative or -0.

``logaddexp(a, b)`` and ``logaddexp2``: onnxscript writes ``log(exp(a) + exp(b))``, which is
``inf`` from a = 89 and ``-inf`` below a = b = -104 (log-probabilities of a long sequence, a
log-space recursion). PyTorch's: ``max(a, b) + log1p(exp(-|a - b|))``, and ``a`` itself where
both are the same infinity.

``remainder`` and ``div(rounding_mode="floor")`` of floats: onnxscript writes ``a - floor(a / b) *
b`` and ``floor(a / b)``. ``a / b`` is rounded before the floor, so ``5.0 // 0.1`` gave 50 where
PyTorch (and Python) give 49, and ``5.0 % 0.1`` gave 0 where PyTorch gives 0.09999993 (0.1 is not
0.1 in binary); a large ``a`` lost every digit (``1e20 % 501``: 0 for 41). PyTorch's kernels start
from ``fmod``, which is exact (ONNX ``Mod`` with ``fmod=1``), and correct its sign.

``sigmoid``: ONNX Runtime's CPU ``Sigmoid`` kernel (MLAS, 1.32) is accurate in absolute terms
only: below -10 its results are off by up to 4.5 times their value, 0 from -20 on, where PyTorch's
``1 / (1 + exp(-x))`` keeps every digit down to -88. ``log(sigmoid(x))`` (a BPR loss, a
hand-written binary cross-entropy) was ``-inf`` at x = -30 where PyTorch gives -30, and a
hand-written BCE with a 0 label NaN. Spelled out as PyTorch computes it (``Exp`` is exact).

``log2`` and ``log10``: onnxscript writes ``log(x) / log(base)`` in the input's precision, which
misses exact answers by an ulp: ``log2(32768)`` was 14.999999 and ``log10(1e9)`` 8.9999995, so a
``floor`` of them (an exponent, a bucket) was one less than PyTorch's. Computed in float64 and
rounded once, as correctly rounded as PyTorch's kernels for float32 and half inputs.

``sign`` (and ``sgn`` of real tensors): ONNX Runtime's ``Sign`` is NaN at NaN, PyTorch's kernel
``(0 < x) - (x < 0)`` is 0 there (an ``abs``'s gradient at a NaN: 0 in PyTorch). ``logit`` with an
``eps``: onnxscript clamps with a ``Where`` on ``x <= 1 - eps``, which made NaN ``1 - eps`` (a
finite 13.8); PyTorch's clamp keeps NaN. Written as PyTorch's kernel computes it, in the tensor's
own dtype (wave 37).

``signbit``: onnxscript writes ``x < 0``, False at -0.0 where PyTorch reads the sign bit (True): a
mask of negative values flipped for the zeros a ``neg`` or a product made negative. ``x < 0`` or a
zero whose reciprocal is ``-inf``, in float32 for half precision. (A NaN's sign bit stays unread:
no ONNX operator of a float reads it; PyTorch's True for ``-nan`` is False here.)

(wave 35; ``tests/export/test_spelled_out_math.py`` compares each with PyTorch on signed zeros,
infinities, NaN, subnormals and magnitudes from 1e-20 to 1e9.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)


def spell_out_math(gm: torch.fx.GraphModule) -> int:
    """Replace each node of ``gm`` that has an exact form here by that form; returns how many."""
    return rewrite_nodes(gm, _exact_form)


def _exact_form(node: torch.fx.Node) -> torch.fx.Node | None:
    form = _FORMS.get(node.target) if node.op == "call_function" else None
    if form is None:
        return None
    if node.target in _FLOOR_MODE and node.kwargs.get("rounding_mode") != "floor":
        return None
    value = node.meta.get("val")
    # A test of a float (signbit) returns booleans: the operand's dtype is the one that matters.
    tested = (
        node.args[0].meta.get("val")
        if node.target in _TESTS and isinstance(node.args[0], torch.fx.Node)
        else value
    )
    if not isinstance(tested, torch.Tensor) or not tested.dtype.is_floating_point:
        return None
    if node.target in _IN_FLOAT64 and value.dtype == torch.float64:
        return None  # nothing wider to compute in
    builder = NodeBuilder(node.graph, value)
    return builder.rounded(form(builder, *node.args))


def rewrite_nodes(gm: torch.fx.GraphModule, rewrite: Callable[[torch.fx.Node], Any]) -> int:
    """Replace each node of ``gm`` for which ``rewrite(node)``, inserting before it, returns what
    stands for it (None: the node stays, and ``rewrite`` inserted nothing); returns how many."""
    replaced = 0
    for node in list(gm.graph.nodes):
        with gm.graph.inserting_before(node):
            written = rewrite(node)
        if written is None:
            continue
        node.replace_all_uses_with(written)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced


def call_with_value(
    graph: torch.fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    fake_mode: Any = None,
) -> torch.fx.Node:
    """A ``target(*args, **kwargs)`` node at the graph's insertion point, with the value the export
    reads (``meta["val"]``), computed by ``target`` on its operands' values (under ``fake_mode``).
    A list operand (``cat``'s tensors) is read element by element."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)

    def value(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return a.meta["val"]
        return [value(item) for item in a] if isinstance(a, list) else a

    values = [value(a) for a in args]
    if fake_mode is None:
        node.meta["val"] = target(*values, **kwargs)
    else:
        with fake_mode:
            node.meta["val"] = target(*values, **kwargs)
    return node


class NodeBuilder:
    """Inserts ATen nodes at the graph's insertion point, each with the fake value the export
    reads (its dtype and shape), computed by the operator itself under the graph's fake mode."""

    def __init__(self, graph: torch.fx.Graph, result: torch.Tensor) -> None:
        self.graph = graph
        self.result = result
        self.mode = getattr(result, "fake_mode", None)
        self.dtype = torch.float32 if result.dtype in _HALF else result.dtype

    def call(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return call_with_value(self.graph, target, args, kwargs, fake_mode=self.mode)

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

    def log1p(self, t: torch.fx.Node) -> torch.fx.Node:
        """``log(1 + t)`` to full precision for a small ``t`` (onnxscript's is ``log(1 + t)``, 0
        below 1e-8): ``log(u) * t / (u - 1)`` with ``u = 1 + t`` rounded, ``t`` where ``u`` is 1."""
        u = self.call(aten.add.Tensor, t, self.operand(1.0))
        ratio = self.call(aten.div.Tensor, t, self.call(aten.sub.Tensor, u, self.operand(1.0)))
        scaled = self.call(aten.mul.Tensor, self.call(aten.log.default, u), ratio)
        return self.call(aten.where.self, self.call(aten.ne.Scalar, u, 1), scaled, t)

    def rounded(self, exact: torch.fx.Node) -> torch.fx.Node:
        """``exact`` in the node's own dtype (half precision was computed in float32)."""
        if self.result.dtype != self.dtype:
            return self.call(aten._to_copy.default, exact, dtype=self.result.dtype)
        return exact


def _atan2(b: NodeBuilder, y_arg: Any, x_arg: Any) -> torch.fx.Node:
    # ONNX Runtime's Where returns +0 where it picks a -0 of its *first* branch (its second keeps
    # the sign: onnxruntime 1.32, CPU), so every value that may be a signed zero travels through a
    # Where's second branch or through arithmetic.
    y, x = b.operand(y_arg), b.operand(x_arg)
    both_zero = b.call(aten.logical_and.default, b.call(aten.eq.Scalar, y, 0), b.call(aten.eq.Scalar, x, 0))
    divisor = b.call(aten.where.self, both_zero, b.operand(1.0), x)  # y / 1 is y, its sign kept
    both_infinite = b.call(
        aten.logical_and.default, b.call(aten.isinf.default, y), b.call(aten.isinf.default, x)
    )
    diagonal = b.call(aten.mul.Tensor, b.call(aten.sign.default, y), b.call(aten.sign.default, x))
    slope = b.call(aten.where.self, both_infinite, diagonal, b.call(aten.div.Tensor, y, divisor))
    angle = b.call(aten.atan.default, slope)
    half_turn = b.call(aten.where.self, b.negative(y), b.operand(-math.pi), b.operand(math.pi))
    turned = b.call(aten.add.Tensor, angle, half_turn)
    return b.call(aten.where.self, b.negative(x), turned, angle)


def _log_add(b: NodeBuilder, x_arg: Any, y_arg: Any, *, base2: bool) -> torch.fx.Node:
    x, y = b.operand(x_arg), b.operand(y_arg)
    top = b.call(aten.maximum.default, x, y)
    gap = b.call(aten.neg.default, b.call(aten.abs.default, b.call(aten.sub.Tensor, x, y)))
    if base2:
        rest = b.call(aten.mul.Tensor, b.log1p(b.call(aten.exp2.default, gap)), b.operand(1 / math.log(2)))
    else:
        rest = b.log1p(b.call(aten.exp.default, gap))
    summed = b.call(aten.add.Tensor, top, rest)
    # the same infinity twice: its own (their difference is NaN)
    same_infinity = b.call(
        aten.logical_and.default, b.call(aten.isinf.default, x), b.call(aten.eq.Tensor, x, y)
    )
    return b.call(aten.where.self, same_infinity, x, summed)


def _sign_corrected(b: NodeBuilder, mod: torch.fx.Node, y: torch.fx.Node) -> torch.fx.Node:
    """Where ``fmod``'s remainder and the divisor differ in sign (the remainder not 0)."""
    differ = b.call(aten.ne.Tensor, b.call(aten.lt.Scalar, y, 0), b.call(aten.lt.Scalar, mod, 0))
    return b.call(aten.logical_and.default, b.call(aten.ne.Scalar, mod, 0), differ)


def _remainder(b: NodeBuilder, x_arg: Any, y_arg: Any) -> torch.fx.Node:
    x, y = b.operand(x_arg), b.operand(y_arg)
    mod = b.call(aten.fmod.Tensor, x, y)
    # mod in the second branch: a -0 remainder stays -0, as PyTorch's
    return b.call(aten.where.self, _sign_corrected(b, mod, y), b.call(aten.add.Tensor, mod, y), mod)


def _floor_divide(b: NodeBuilder, x_arg: Any, y_arg: Any) -> torch.fx.Node:
    x, y = b.operand(x_arg), b.operand(y_arg)
    quotient = b.call(aten.div.Tensor, x, y)
    mod = b.call(aten.fmod.Tensor, x, y)
    exact = b.call(aten.div.Tensor, b.call(aten.sub.Tensor, x, mod), y)
    exact = b.call(
        aten.where.self, _sign_corrected(b, mod, y), b.call(aten.sub.Tensor, exact, b.operand(1.0)), exact
    )
    floor = b.call(aten.floor.default, exact)
    rounded_up = b.call(aten.gt.Scalar, b.call(aten.sub.Tensor, exact, floor), 0.5)
    floor = b.call(aten.where.self, rounded_up, b.call(aten.add.Tensor, floor, b.operand(1.0)), floor)
    result = b.call(aten.where.self, b.call(aten.eq.Scalar, y, 0), quotient, floor)
    # The sign of x / y, for a zero too (PyTorch: copysign(0, x / y)). Multiplied in: ONNX Runtime
    # turns a -0 that Where picks into +0 (see _atan2), and its NotWhereFusion swaps the branches
    # of a Where whose condition is a Not.
    sign = b.call(aten.where.self, b.negative(quotient), b.operand(-1.0), b.operand(1.0))
    return b.call(aten.mul.Tensor, b.call(aten.abs.default, result), sign)


def _one_plus_exp_neg(b: NodeBuilder, x: torch.fx.Node) -> torch.fx.Node:
    """``1 + exp(-x)``: the denominator of PyTorch's sigmoid and silu kernels."""
    return b.call(aten.add.Tensor, b.call(aten.exp.default, b.call(aten.neg.default, x)), b.operand(1.0))


def _sigmoid(b: NodeBuilder, x_arg: Any) -> torch.fx.Node:
    # PyTorch's kernel: 1 / (1 + exp(-x)); 0 below -88.7 where exp(-x) overflows, as PyTorch's
    return b.call(aten.reciprocal.default, _one_plus_exp_neg(b, b.operand(x_arg)))


def _silu(b: NodeBuilder, x_arg: Any) -> torch.fx.Node:
    # PyTorch's kernel: x / (1 + exp(-x)); through ONNX Runtime's Sigmoid, 0 from -20 on where
    # PyTorch's is -4.1e-8 at -20 (wave 45's review: SwiGLU's and Mish's small negative values).
    x = b.operand(x_arg)
    return b.call(aten.div.Tensor, x, _one_plus_exp_neg(b, x))


def _silu_backward(b: NodeBuilder, grad_arg: Any, x_arg: Any) -> torch.fx.Node:
    # PyTorch's kernel: dy * s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x))
    x, grad = b.operand(x_arg), b.operand(grad_arg)
    s = _sigmoid(b, x)
    inner = b.call(aten.mul.Tensor, x, b.call(aten.sub.Tensor, b.operand(1.0), s))
    factor = b.call(aten.mul.Tensor, s, b.call(aten.add.Tensor, inner, b.operand(1.0)))
    return b.call(aten.mul.Tensor, grad, factor)


def _expm1(b: NodeBuilder, x: torch.fx.Node) -> torch.fx.Node:
    """``expm1(x)`` for ``x <= 0`` in ONNX, which has none. Below -ln 2 (``u = exp(x) < 1/2``)
    ``u - 1`` is rounded once, as a correctly rounded ``expm1`` is: ELU's backward of its result,
    ``grad * (y + alpha)``, cancels there and magnifies any other rounding (the review of wave 47's
    diff: a few % off eager's input gradients below -10 with the formula below). Above it, where
    ``u - 1`` cancels: Kahan's ``(u - 1) * x / log(u)``, whose roundings of ``u - 1`` and
    ``log(u)`` cancel (a few ulp); ``x`` itself where ``u`` rounds to 1 (-0 stays -0)."""
    u = b.call(aten.exp.default, x)
    u_minus_1 = b.call(aten.sub.Tensor, u, b.operand(1.0))
    ratio = b.call(aten.div.Tensor, b.call(aten.mul.Tensor, u_minus_1, x), b.call(aten.log.default, u))
    far = b.call(aten.lt.Scalar, x, -math.log(2.0))
    result = b.call(aten.where.self, far, u_minus_1, ratio)
    return b.call(aten.where.self, b.call(aten.eq.Scalar, u, 1.0), x, result)


def _elu(
    b: NodeBuilder, x_arg: Any, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0
) -> torch.fx.Node:
    # PyTorch's kernel: scale * alpha * expm1(x * input_scale) for x <= 0, scale * x above. ONNX
    # has no Expm1: ONNX Runtime's Elu computes exp(x) - 1, exact to one rounding of 1, not of
    # the result (elu(-1e-6) was 1.3% off; SELU and CELU, which decompose to elu, too: wave 47's
    # review).
    x = b.operand(x_arg)
    below = b.call(
        aten.mul.Tensor,
        _expm1(b, b.call(aten.mul.Tensor, x, b.operand(input_scale))),
        b.operand(scale * alpha),
    )
    above = b.call(aten.mul.Tensor, x, b.operand(scale))
    return b.call(aten.where.self, b.call(aten.gt.Scalar, x, 0), above, below)


def _log_base(b: NodeBuilder, x_arg: Any, *, base: float) -> torch.fx.Node:
    # log(x) / log(base) rounded in float64 and then to float32: correctly rounded for float32
    # inputs (log2(32768) is 15, log10(1e9) is 9), as PyTorch's log2 and log10 kernels are.
    wide = b.call(aten._to_copy.default, b.operand(x_arg), dtype=torch.float64)
    ratio = b.call(aten.scalar_tensor.default, 1.0 / math.log(base), dtype=torch.float64)
    scaled = b.call(aten.mul.Tensor, b.call(aten.log.default, wide), ratio)
    return b.call(aten._to_copy.default, scaled, dtype=b.dtype)


def _sign(b: NodeBuilder, x_arg: Any) -> torch.fx.Node:
    # PyTorch's kernel: (0 < x) - (x < 0), so 0 for NaN (ONNX Runtime's Sign: NaN) and +0 for -0
    x = b.operand(x_arg)
    above = b.call(aten._to_copy.default, b.call(aten.gt.Scalar, x, 0), dtype=b.dtype)
    below = b.call(aten._to_copy.default, b.call(aten.lt.Scalar, x, 0), dtype=b.dtype)
    return b.call(aten.sub.Tensor, above, below)


def _signbit(b: NodeBuilder, x: torch.fx.Node) -> torch.fx.Node:
    if x.meta["val"].dtype in _HALF:  # the sign of a zero survives the cast
        x = b.call(aten._to_copy.default, x, dtype=torch.float32)
    return b.negative(x)


def _logit(b: NodeBuilder, x_arg: Any, eps: float | None = None) -> torch.fx.Node:
    # PyTorch's kernel: x clamped to [eps, 1 - eps] keeping NaN, then log(x / (1 - x)), each
    # operation in the tensor's own dtype (half precision included); onnxscript's clamp is a Where
    # on x <= 1 - eps, which turned NaN into 1 - eps.
    def number(value: float) -> torch.fx.Node:
        return b.call(aten.scalar_tensor.default, value, dtype=b.result.dtype)

    x = x_arg
    if eps is not None:
        low, high = number(eps), number(1 - eps)
        x = b.call(aten.where.self, b.call(aten.lt.Tensor, x, low), low, x)
        x = b.call(aten.where.self, b.call(aten.gt.Tensor, x, high), high, x)
    return b.call(aten.log.default, b.call(aten.div.Tensor, x, b.call(aten.sub.Tensor, number(1.0), x)))


_FORMS: dict[Any, Callable[..., torch.fx.Node]] = {
    aten.sign.default: _sign,
    aten.signbit.default: _signbit,
    aten.sgn.default: _sign,
    aten.logit.default: _logit,
    aten.log2.default: lambda b, x: _log_base(b, x, base=2.0),
    aten.log10.default: lambda b, x: _log_base(b, x, base=10.0),
    aten.sigmoid.default: _sigmoid,
    aten.silu.default: _silu,
    aten.silu_backward.default: _silu_backward,
    aten.elu.default: _elu,
    aten.celu.default: lambda b, x, alpha=1.0: _elu(b, x, alpha, 1.0, 1.0 / alpha),
    aten.atan2.default: _atan2,
    aten.logaddexp.default: lambda b, x, y: _log_add(b, x, y, base2=False),
    aten.logaddexp2.default: lambda b, x, y: _log_add(b, x, y, base2=True),
    aten.remainder.Tensor: _remainder,
    aten.remainder.Scalar: _remainder,
    aten.remainder.Scalar_Tensor: _remainder,
    aten.div.Tensor_mode: _floor_divide,
    aten.div.Scalar_mode: _floor_divide,
}
_FLOOR_MODE = frozenset({aten.div.Tensor_mode, aten.div.Scalar_mode})
_IN_FLOAT64 = frozenset({aten.log2.default, aten.log10.default})
# Operators that test a float and return booleans.
_TESTS = frozenset({aten.signbit.default})
