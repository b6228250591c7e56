"""Plain Python values: what a captured graph may have baked in, read and compared by value.

Numbers, strings, booleans, ``None``, and short tuples and lists of them (a conv's ``padding``, a
norm's shape). The guards read module attributes, class attributes and the module-level values a
forward names this way (:mod:`ortrain.ortmodule.guards`, :mod:`ortrain.capture.global_reads`).
"""

from __future__ import annotations

from typing import Any

PLAIN = frozenset({bool, int, float, str, type(None)})
SEQUENCES = frozenset({tuple, list})
SHORT = 64  # longer sequences (a vocabulary kept as a list) are watched by identity, not read
NOT_PLAIN = object()


def plain_form(value: Any) -> Any:
    """``value`` if plain, a short sequence of plain values as a tuple, else ``NOT_PLAIN``."""
    kind = type(value)
    if kind in PLAIN:
        return value
    if kind in SEQUENCES and len(value) <= SHORT and all(type(i) in PLAIN for i in value):
        return tuple(value)
    return NOT_PLAIN
