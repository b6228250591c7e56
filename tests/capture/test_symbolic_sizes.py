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
