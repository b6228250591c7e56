"""Keep Python's cyclic garbage collector off the objects that existed before a compile.

Capture and export allocate millions of short-lived objects, so Python's collector runs its full
(oldest-generation) collection several times during a first step, and ortrain collects once more
after export to give the exporter's example tensors back. Each full collection walks every object
in the process: torch, onnxscript and onnxruntime's modules alone make it 0.1-0.3 s (2-core AMD
EPYC), 0.9-1.2 s a first step of the tiny GPT in all. Freezing the objects that exist when the
compile starts (``gc.freeze``) takes them out of those walks, and unfreezing them afterwards puts
them back, so nothing stays uncollectable: garbage among them waits for the next full collection
after the compile, as it would have waited for the next one anyway.

A full collection during the compile (there are several, and ortrain's own after export) counts
only the objects it walked as long-lived, so Python would start its next full collection soon
after the compile, on the next step (a 0.2-0.3 s pause there: the tiny GPT's second step measured
0.31 -> 0.50 s). So when one ran, the compile ends with one full collection over everything,
which resets that count as a collection before the compile would have; a compile that ran none
(graphs loaded from ``ORTMODULE_CACHE_DIR``) ends without it.

A process that froze objects itself (``gc.freeze`` before forking workers, say) is left alone:
unfreezing would undo its choice.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_DEPTH = 0  # nested compiles (a graph break inside a compile) unfreeze once, at the outermost exit


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """While compiling: collections walk only the objects created since it began."""
    global _DEPTH
    with _LOCK:
        owned = _DEPTH > 0 or gc.get_freeze_count() == 0
        full_collections = _full_collections()
        if owned:
            if _DEPTH == 0:
                gc.freeze()
            _DEPTH += 1
    try:
        yield
    finally:
        if owned:
            with _LOCK:
                _DEPTH -= 1
                if _DEPTH == 0:
                    gc.unfreeze()
                    if _full_collections() != full_collections:
                        gc.collect()


def _full_collections() -> int:
    return int(gc.get_stats()[-1]["collections"])
