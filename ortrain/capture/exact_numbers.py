"""Plain numbers as the guards compare them: by type, sign and NaN as well as by value.

Python's ``==`` says ``3 == 3.0 == True`` and ``0.0 == -0.0``, and a NaN is unequal to itself. A
graph can depend on exactly those differences (``torch.arange(k)`` is int64 for ``3`` and float32
for ``3.0``; ``atan2(z, -0.0)``; ``isinstance(flag, bool)``), so until wave 44 a model attribute,
config entry or global changed from ``3`` to ``3.0`` kept the old graph, silently, while a NaN set
again at every step ("changed from nan to nan") captured at every step. The guards hold floats and
bools in these forms: equal only to the same kind of number with the same bits, shown as the
number itself in the messages that say what changed.
"""

from __future__ import annotations

import math
from typing import Any

from ortrain.capture.plain_values import plain_form

_NAN_HASH = hash("nan")


class ExactFloat(float):
    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if type(other) is not ExactFloat:
            return False
        mine, theirs = float(self), float(other)
        if mine != mine:  # NaN: equal to a NaN
            return theirs != theirs
        return mine == theirs and math.copysign(1.0, mine) == math.copysign(1.0, theirs)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        # NaN's own hash is its identity's: every NaN equals every other here, so one hash for all.
        # (Not through repr: the guards hash keys full of these at every call.)
        value = float(self)
        return hash(value) if value == value else _NAN_HASH


class ExactBool(int):
    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is ExactBool and int(self) == int(other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return int.__hash__(self)

    def __repr__(self) -> str:
        return repr(bool(self))


def exact(form: Any) -> Any:
    """``form`` (a plain value or a tuple of them) with its floats and bools in exact forms."""
    kind = type(form)
    if kind is float:
        return ExactFloat(form)
    if kind is bool:
        return ExactBool(form)
    if kind is tuple:
        return tuple(exact(item) for item in form)
    return form


def exact_plain_form(value: Any) -> Any:
    """``plain_values.plain_form(value)`` with its floats and bools exact: how the guards compare
    plain values (``NOT_PLAIN`` where ``value`` is not plain)."""
    return exact(plain_form(value))
