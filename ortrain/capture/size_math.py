"""``math.sqrt`` of a size left open, kept symbolic while capturing.

A capture with open sizes traces the forward's Python with symbolic sizes. ``math.sqrt(T)`` of a
sequence length (an attention or loss scale) asks the size for a Python float, which fixes it:
the graph held for that length only, and each new length captured again (wave 50's review).
PyTorch keeps ``torch.sym_sqrt(T)`` symbolic (and the export computes it in float64, as Python
does: :mod:`ortrain.export.double_precision_sizes`), so while capturing ``math.sqrt`` hands
symbolic numbers to it and every other argument to Python's own. Only the module attribute is
replaced: ``from math import sqrt`` binds the original, which fixes the size as before.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

_SQRT = math.sqrt


def _sqrt(x: float) -> float:
    if isinstance(x, torch.SymInt | torch.SymFloat):
        return torch.sym_sqrt(x)  # type: ignore[return-value]
    return _SQRT(x)


@contextlib.contextmanager
def symbolic_math_of_sizes() -> Iterator[None]:
    """Meanwhile, ``math.sqrt`` of a symbolic size stays symbolic (see the module)."""
    math.sqrt = _sqrt  # type: ignore[assignment]
    try:
        yield
    finally:
        math.sqrt = _SQRT
