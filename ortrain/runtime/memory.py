"""The C library's allocator, through ctypes: give memory freed by Python back to the operating
system, and look up its other functions (``ortrain.runtime.freed_memory_reuse``'s ``mallopt``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def libc_function(name: str) -> Any:
    """The C library's function ``name``, or None where it has no such function (or no C library
    is found)."""
    library = ctypes.util.find_library("c")
    if not library:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """glibc keeps freed chunks in its heaps; after export that is hundreds of MiB of peak RSS."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)
