"""Give memory freed by Python back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():  # type: ignore[no-untyped-def]
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """glibc keeps freed chunks in its heaps; after export that is hundreds of MiB of peak RSS."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
