"""Size formulas in PyTorch's own sympy functions, evaluated per call."""

from __future__ import annotations

import math

import sympy

from ortrain.capture.symbolic_sizes import (
    SizeCeil,
    SizeFloorDiv,
    SizeMax,
    SizePythonMod,
    SizeTrueDiv,
    size_function,
)


def test_size_functions_evaluate_floor_division_remainder_ceiling_and_max() -> None:
    t, n = sympy.symbols("s7 u3", integer=True, positive=True)
    exprs = [
        SizeFloorDiv(t - SizePythonMod(t, 2), 2),
        SizeCeil(SizeTrueDiv(t, 3)),
        SizeMax(t, n) * 2 + 1,
        sympy.Integer(5),
    ]
    formula = size_function([t, n], exprs)
    for length, count in ((8, 3), (11, 20), (1, 1)):
        assert formula(length, count) == [
            (length - length % 2) // 2,
            math.ceil(length / 3),
            max(length, count) * 2 + 1,
            5,
        ]


def test_a_size_scaled_by_a_float_evaluates() -> None:
    """``interpolate(scale_factor=0.5)``'s output size, ``trunc(0.5 * float(s0))``: PyTorch prints
    it with ``torch.sym_float``, which the formula's namespace lacked until wave 41 (NameError)."""
    from torch.utils._sympy.functions import ToFloat, TruncToInt

    t = sympy.Symbol("s0", integer=True, positive=True)
    formula = size_function([t], [TruncToInt(sympy.Float(0.5) * ToFloat(t))])
    assert [formula(n)[0] for n in (4, 7, 10)] == [2, 3, 5]
