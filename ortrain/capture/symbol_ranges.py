"""The values a size symbol of a capture may take, as its shape environment recorded them.

A capture with open sizes records, for each size symbol, the range its guards allow: a reflect pad
of 32 needs a length of at least 33, a slice ``x[:, 1:]`` of it one more. Whoever makes example
tensors for such a graph (the exporter's) must stay inside that range, or tracing the graph again
fails its own guards.
"""

from __future__ import annotations

import sympy
import torch


def symbol_range(size: object, symbol: sympy.Symbol) -> tuple[int, int | None]:
    """The smallest and largest value (None: unbounded) ``symbol`` may take, read from the shape
    environment of ``size`` (a ``torch.SymInt`` over it); (0, None) where none is recorded."""
    node = getattr(size, "node", None) if isinstance(size, torch.SymInt) else None
    shape_env = getattr(node, "shape_env", None)
    bounds = shape_env.var_to_range.get(symbol) if shape_env is not None else None
    if bounds is None:
        return 0, None
    return _finite(bounds.lower) or 0, _finite(bounds.upper)


def _finite(bound: sympy.Expr) -> int | None:
    # Ranges are bounded by integers or by infinities (sympy's, or torch's int_oo).
    return int(bound) if isinstance(bound, sympy.Integer) else None
