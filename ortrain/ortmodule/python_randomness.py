"""Python's own random numbers (``random``, ``numpy.random``) drawn inside ``forward``.

A captured graph holds what one trace of the forward did: ``if random.random() < p:`` (LayerDrop,
stochastic depth) or ``np.random.uniform(...)`` is drawn once, while tracing, and every later step
repeats that draw, the same layers dropped at every step. Tracing also advanced the user's
generators, so the numbers later drawn outside the model moved too. TorchDynamo calls such
functions at every run of its graphs, in eager's order.

So capture and ortrain's eager error check run with these generators saved and put back, and a
capture during which they moved is refused with :class:`PythonRandomnessError`: the model then
trains through TorchDynamo's graph breaks.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any


class PythonRandomnessError(RuntimeError):
    """The forward drew from Python's ``random`` or ``numpy.random`` while it was captured."""


def _states() -> list[tuple[Any, Any]]:
    """(how to restore, state) of each generator the forward may draw from."""
    states: list[tuple[Any, Any]] = [(random.setstate, random.getstate())]
    numpy = sys.modules.get("numpy")  # a forward that uses NumPy has imported it
    if numpy is not None:
        states.append((numpy.random.set_state, numpy.random.get_state()))
    return states


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)  # NumPy's key array


@contextlib.contextmanager
def python_generators_kept() -> Iterator[list[bool]]:
    """Put ``random``'s and ``numpy.random``'s states back on exit; the list it yields holds one
    flag, set on exit when the body drew from either."""
    before = _states()
    drawn = [False]
    try:
        yield drawn
    finally:
        after = _states()
        # Only generators there before count: importing NumPy while tracing draws nothing.
        drawn[0] = any(not _same(a, b) for (_, a), (_, b) in zip(before, after, strict=False))
        for restore, state in before:
            restore(state)


@contextlib.contextmanager
def refusing_python_randomness() -> Iterator[None]:
    """Raise :class:`PythonRandomnessError` if the body drew from Python's generators (put back)."""
    with python_generators_kept() as drawn:
        yield
    if drawn[0]:
        raise PythonRandomnessError(
            "the forward draws Python random numbers (random or numpy.random): a captured graph "
            "would repeat one draw at every step"
        )
