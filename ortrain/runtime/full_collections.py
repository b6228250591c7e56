"""No automatic full garbage collection while compiling.

Capture and export allocate millions of short-lived objects, so Python's collector started its
full (oldest-generation) collection several times during a first step, each walking every object
in the process: torch, onnxscript and onnxruntime alone make that 0.2-0.3 s on the 2-core AMD
EPYC, 0.6 s of the tiny GPT's first step; and ortrain collects once more after export anyway, to
give the exporter's example tensors back. While a compile runs, automatic collections stay on for
the young generations (most garbage dies there) but not for the oldest: the compile's own
collection after export is then the only full one. After a compile that collects nothing (its
graphs loaded from ``ORTMODULE_CACHE_DIR``), a full collection that fell due during it is Python's
to start at its next young collection, if its own check still wants one. Peak memory measured
the same (tiny GPT: 847-878 MiB before, 859-869 after).

(Freezing the objects that existed before the compile, ``gc.freeze``, was tried first: the
collections inside then counted only the young objects as long-lived, so Python's next full
collection fell on the second step, 0.2 s later, and the compile had to end with a full one.)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_DEPTH = 0  # nested compiles (a graph break inside a compile): the outermost restores
_NEVER = 1 << 30


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """While compiling: the young generations are collected as usual, the oldest only on demand."""
    global _DEPTH
    with _LOCK:
        outermost = _DEPTH == 0
        _DEPTH += 1
        if outermost:
            thresholds = gc.get_threshold()
            gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if outermost:
                gc.set_threshold(*thresholds)
