"""``torch.profiler.record_function`` ranges inside a forward are left out of the capture.

A range is two operators of PyTorch's profiler (``profiler._record_function_enter_new`` and
``_record_function_exit``), which a trace records as graph nodes. ONNX has no translation for
them: a forward with ranges (its own, or ``nn.DataParallel``'s around a submodule) was split into
PyTorch and ONNX Runtime regions around each one, 1.5x slower per step on an 8-layer MLP, and
refused under ``FALLBACK_DISABLE`` (wave 47's review). A captured graph does not run the forward's
Python, so its ranges could mark nothing of it anyway; ``torch.profiler`` still records ortrain's
own ranges and every operator the graphs run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.autograd.profiler import record_function


def _enter(self: record_function) -> record_function:
    # Nothing of the instance changes: one used as a decorator is entered again by eager calls
    # after the capture (the review of wave 47's diff: a flag set here left its later ranges open).
    return self


def _exit(self: record_function, *exc_info: Any) -> None:
    return None


@contextlib.contextmanager
def profiler_ranges_left_out() -> Iterator[None]:
    """While tracing: ``record_function`` ranges record no operators."""
    enter, exit_ = record_function.__enter__, record_function.__exit__
    record_function.__enter__ = _enter  # type: ignore[method-assign]
    record_function.__exit__ = _exit  # type: ignore[method-assign]
    try:
        yield
    finally:
        record_function.__enter__ = enter  # type: ignore[method-assign]
        record_function.__exit__ = exit_  # type: ignore[method-assign]
