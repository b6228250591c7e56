"""Per-operator time inside ONNX Runtime, from its own profiler (for the benchmarks).

While :func:`profiling` is active, the sessions ortrain creates record every kernel they run (with
ONNX Runtime's arena on, so that the profiler's allocations leave the kernels' times as they are);
:func:`operator_times` ends those recordings and sums the kernel time per ONNX operator type.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnxruntime as ort

_prefix: str | None = None
_sessions: list[ort.InferenceSession] = []


@contextlib.contextmanager
def profiling(directory: Path) -> Iterator[None]:
    """Sessions created inside write their profiles under ``directory``."""
    global _prefix
    directory.mkdir(parents=True, exist_ok=True)
    _prefix = str(directory / "ortrain_session")
    try:
        yield
    finally:
        _prefix = None


def configure(options: ort.SessionOptions) -> None:
    """Called on each session's options before the session is created."""
    if _prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = _prefix
        # ortrain's sessions run without ONNX Runtime's arena (their large outputs come from
        # malloc, which keeps freed blocks for reuse: runtime.freed_memory_reuse). The profiler's
        # own allocations, live until the profile ends, stop malloc from reusing them: tiny GPT,
        # 28 000 page faults and 360 ms of system time a step, 406 ms against 166 unprofiled, and
        # the faults charged to whichever node wrote a large output first (Exp at 69 ms a step).
        # With the arena a profiled step measures 160 ms and its kernels add up to it.
        options.enable_cpu_mem_arena = True


def track(session: ort.InferenceSession) -> None:
    if _prefix is not None or session.get_session_options().enable_profiling:
        _sessions.append(session)


def take_tracked() -> list[ort.InferenceSession]:
    """The profiled sessions created so far, which :func:`operator_times` then no longer sees: for
    a caller that profiles several models in one process and reads each one's times apart."""
    taken = list(_sessions)
    _sessions.clear()
    return taken


def operator_times(*, skip_runs: int = 0, sessions: list[ort.InferenceSession] | None = None) -> Counter[str]:
    """Microseconds per ONNX operator type over every profiled session's runs (or over
    ``sessions``, from :func:`take_tracked`), leaving out each session's first ``skip_runs`` runs
    (warm-up); the profiles end."""
    totals: Counter[str] = Counter()
    pending = _sessions if sessions is None else list(sessions)
    while pending:
        path = Path(pending.pop().end_profiling())
        events: list[dict[str, Any]] = json.loads(path.read_text())
        runs = sorted(e["ts"] + e.get("dur", 0) for e in events if e.get("name") == "model_run")
        after = runs[skip_runs - 1] if 0 < skip_runs <= len(runs) else (-1 if skip_runs == 0 else None)
        if after is None:
            continue  # the session never ran past its warm-up
        for event in events:
            if (
                event.get("cat") == "Node"
                and str(event.get("name", "")).endswith("_kernel_time")
                and event.get("ts", 0) > after
            ):
                totals[event.get("args", {}).get("op_name", "?")] += int(event.get("dur", 0))
    return totals
