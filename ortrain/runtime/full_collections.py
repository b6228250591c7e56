"""No full garbage collection over the whole process while compiling, and none after it.

Capture and export allocate millions of short-lived objects, so Python's collector started its
full (oldest-generation) collection several times during a first step, each walking every object
in the process: torch, onnxscript and onnxruntime alone make that 0.2-0.3 s on the 2-core AMD
EPYC, 0.6 s of the tiny GPT's first step. While a compile runs, automatic collections stay on for
the young generations (most garbage dies there) but not for the oldest.

The compile ends with one collection of its own garbage (``compile_garbage_collected``): capture and
export leave 60 000 to 130 000 objects in reference cycles (the tiny GPT's captures), memory
ortrain gives back before training goes on. The objects that existed before the compile are frozen
meanwhile (``gc.freeze``), so that collection walks the compile's objects only. Measured on the
2-core Intel Xeon: the tiny GPT's first capture 0.13 s against 0.35 s for a walk of the whole
process, its re-capture 0.21 s against 0.47, the MLP 0.04 s against 0.21; in a process that holds
more (a test session, a notebook with a dataset) the gap grows: 0.05 s against 0.30 per capture in
ortrain's tests. Freezing moves lists, it copies nothing; a process that froze objects of its own
is left as it is (the collection then walks whatever is not frozen, as before this module froze
anything).

(Freezing alone, without deferring, was tried first: the automatic full collections inside the
compile then counted only the young objects as long-lived, so Python's next full collection fell
on the second step. Deferred, the compile's own collection is its only one: 40 steps of the tiny
GPT and of the MLP after it ran no automatic full collection.)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from ortrain.runtime.memory import release_freed_memory

_LOCK = threading.Lock()
_DEPTH = 0  # nested compiles (a graph break inside a compile): the outermost restores
_FROZEN = False  # whether the outermost compile froze the process's objects
_NEVER = 1 << 30


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """While compiling: the young generations are collected as usual, the oldest only on demand,
    and the objects that existed before are frozen."""
    global _DEPTH, _FROZEN
    with _LOCK:
        outermost = _DEPTH == 0
        _DEPTH += 1
        if outermost:
            thresholds = gc.get_threshold()
            gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
            _FROZEN = gc.get_freeze_count() == 0  # never unfreeze what the user froze
            if _FROZEN:
                gc.freeze()
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if outermost:
                if _FROZEN:
                    gc.unfreeze()
                    _FROZEN = False
                gc.set_threshold(*thresholds)


def collect_compile_garbage() -> int:
    """Collect the garbage of the compile running now: inside ``full_collections_deferred`` only
    the objects made since it began are walked. Returns the number of objects collected."""
    return gc.collect()


@contextlib.contextmanager
def compile_garbage_collected() -> Iterator[None]:
    """What every compile runs in (a capture, op tuning's lazy export, a graph of the compile
    backend): ``full_collections_deferred``, closed by a collection of the compile's own garbage
    while the older objects are still frozen, then the freed memory handed back to the system."""
    with full_collections_deferred():
        yield
        collect_compile_garbage()
    release_freed_memory()
