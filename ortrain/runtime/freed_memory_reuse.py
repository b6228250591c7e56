"""Keep the memory a training step frees inside the process, so that the next step reuses it.

glibc's malloc serves every block above its mmap threshold (128 KiB at start, rising with the
blocks freed, to at most 32 MiB) with a fresh ``mmap`` and unmaps it when freed, and gives the
heap's free top back to the system beyond its trim threshold. A training step allocates and frees
the same activations and gradients at every step, so every step faulted their pages in again and
the kernel zeroed them: eager's tiny GPT took 11-28 thousand minor page faults a step (30-66 ms
of system time in a 200-250 ms step on a 2-core Intel Xeon), the MLP 1 200-3 900. With both
thresholds raised, freed blocks stay in the heap and the next step reuses them (0-200 faults a
step). Eager PyTorch gains the same way under the same settings (``GLIBC_TUNABLES``), which the
benchmarks measure too (``eager-malloc``, ``benchmarks/bench_freed_memory.py``); allocators like
jemalloc or tcmalloc, preloaded, keep freed memory their own way.

The settings are process-wide and stay for the process's life: memory freed below the thresholds
is kept for reuse (at most :data:`TRIM_THRESHOLD` of free heap top) instead of being returned,
so the resident size after a step stays near its peak. ``ORTMODULE_REUSE_FREED_MEMORY=0`` leaves
malloc as it is; so does a malloc setting of the user's own (``MALLOC_*_`` variables,
``GLIBC_TUNABLES``, a preloaded allocator).
"""

from __future__ import annotations

import logging
import platform

from ortrain.runtime.memory import libc_function

logger = logging.getLogger("ortrain.runtime.freed_memory_reuse")

# Blocks up to this size come from the heap and are reused; bigger ones (a whole vocabulary's
# logits of a large batch) are still mapped and unmapped, and a process holding one freed block
# that big would be a poor trade.
MMAP_THRESHOLD = 256 << 20
# Free memory at the heap's top beyond this goes back to the system: above a step's working set
# of the models measured (the tiny GPT frees ≈ 200 MiB a step), small against the machines
# that train them.
TRIM_THRESHOLD = 1 << 30

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None  # None: not decided yet in this process
_why_not = "no ORTModule created yet in this process"


def _mallopt():  # type: ignore[no-untyped-def]
    # glibc's only: musl's mallopt accepts nothing, and other systems' C libraries lack it.
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return libc_function("mallopt")


def reuse_freed_memory(enabled: bool, users_setting: str | None) -> bool:
    """Raise glibc malloc's mmap and trim thresholds, once per process; True if this process runs
    with them. ``users_setting``: what of the user's own malloc configuration was found (then
    nothing changes), see :func:`ortrain.ortmodule.options.user_malloc_setting`."""
    global _applied, _why_not
    if _applied is not None:
        return _applied
    _applied = False
    if not enabled:
        _why_not = "ORTMODULE_REUSE_FREED_MEMORY=0"
        logger.debug("freed memory reuse off (ORTMODULE_REUSE_FREED_MEMORY=0): malloc unchanged")
        return False
    if users_setting is not None:
        _why_not = f"malloc left as configured: {users_setting}"
        logger.info("malloc left as configured (%s)", users_setting)
        return False
    mallopt = _mallopt()
    if mallopt is None:
        _why_not = f"not glibc's malloc ({platform.system()})"
        logger.debug("freed memory reuse: not glibc's malloc on %s, nothing to change", platform.system())
        return False
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    _applied = bool(mapped) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _applied:
        logger.info(
            "freed memory stays in this process for reuse (glibc malloc: mmap threshold %d MiB, trim "
            "threshold %d MiB), so steps stop faulting their pages in again; "
            "ORTMODULE_REUSE_FREED_MEMORY=0 turns this off",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
        )
    else:
        _why_not = "glibc's mallopt refused the thresholds"
        logger.warning("glibc's mallopt refused the thresholds; malloc unchanged")
    return _applied


def describe() -> str:
    """This process's state, in words (``ortrain doctor``)."""
    if _applied:
        megabytes = MMAP_THRESHOLD >> 20
        return f"on: freed blocks up to {megabytes} MiB are reused (glibc malloc thresholds raised)"
    return f"off: {_why_not}"
