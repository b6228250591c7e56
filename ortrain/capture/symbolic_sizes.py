"""The sympy classes PyTorch's shape environment writes symbolic sizes with, beyond sympy's own.

A size such as the diagonal length of a dynamic, non-square tensor is ``Min(5, s0)`` in PyTorch's
own ``Min`` class (not ``sympy.Min``); ``T // 2`` is ``FloorDiv(s0, 2)``, ``T % 2``
``PythonMod(s0, 2)``, ``math.ceil(T / 3)`` ``CeilToInt(IntTrueDiv(s0, 3))``. The exporter rebuilds
such sizes from input sizes, and the executors evaluate them per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import sympy
import torch
from torch.utils._sympy.functions import CeilDiv as SizeCeilDiv
from torch.utils._sympy.functions import CeilToInt as SizeCeil
from torch.utils._sympy.functions import FloorDiv as SizeFloorDiv
from torch.utils._sympy.functions import FloorToInt as SizeFloor
from torch.utils._sympy.functions import IntTrueDiv as SizeTrueDiv
from torch.utils._sympy.functions import Max as SizeMax
from torch.utils._sympy.functions import Min as SizeMin
from torch.utils._sympy.functions import Mod as SizeMod
from torch.utils._sympy.functions import PythonMod as SizePythonMod
from torch.utils._sympy.printers import PythonPrinter

__all__ = [
    "SizeCeil",
    "SizeCeilDiv",
    "SizeFloor",
    "SizeFloorDiv",
    "SizeMax",
    "SizeMin",
    "SizeMod",
    "SizePythonMod",
    "SizeTrueDiv",
    "size_function",
]


def size_function(symbols: Sequence[sympy.Symbol], exprs: Sequence[sympy.Expr]) -> Callable[..., list[int]]:
    """``exprs`` as a Python function of the ``symbols``' values, written by PyTorch's own printer
    (the one its guards are written with): ``sympy.lambdify`` knows none of PyTorch's functions."""
    names = [f"_v{i}" for i in range(len(symbols))]
    renamed = [
        sympy.sympify(e).xreplace(dict(zip(symbols, map(sympy.Symbol, names), strict=True))) for e in exprs
    ]
    printer = PythonPrinter()
    body = ", ".join(f"int({printer.doprint(e)})" for e in renamed)
    # The printer writes ``torch.sym_float(...)`` for a true division (``interpolate``'s
    # ``scale_factor=0.5``: ``math.trunc(0.5*torch.sym_float(s0))``); until wave 41 the formula
    # knew no ``torch``, and such a model fell back to PyTorch on its first new size.
    return eval(f"lambda {', '.join(names)}: [{body}]", {"math": math, "torch": torch})
