"""``print`` in a forward that is captured whole runs while ortrain traces, and never again.

The captured graph holds no Python: a debugging ``print("h", h.mean())`` in the forward printed
traced values (``FakeTensor(..., size=())``) two or three times while the model was captured, then
nothing at all (wave 50's review), where eager prints at every step. The prints still happen while
tracing (what they show is the traced structure: shapes, dtypes), and ortrain warns once per
place in the model's code that they will not happen again.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from ortrain.capture.model_code import model_code_calling

logger = logging.getLogger("ortrain.capture")

_warned: set[str] = set()


@contextlib.contextmanager
def print_calls_noted() -> Iterator[None]:
    """Within the block (a capture, on this thread), the model's ``print`` calls are noted."""
    original = builtins.print
    thread = threading.get_ident()

    def noted(*args: Any, **kwargs: Any) -> None:
        where = model_code_calling(2) if threading.get_ident() == thread else None
        if where is not None and where not in _warned:
            _warned.add(where)
            logger.warning(
                "print() in the forward (%s) runs only while ortrain captures the model, where it "
                "shows traced values, not at the steps the captured graph runs: print from the "
                "forward's outputs outside the model, or run it once unwrapped to debug",
                where,
            )
        original(*args, **kwargs)

    builtins.print = noted
    try:
        yield
    finally:
        builtins.print = original
