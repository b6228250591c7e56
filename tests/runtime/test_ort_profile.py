"""The benchmarks' per-operator breakdown: profiled sessions keep ONNX Runtime's arena."""

from __future__ import annotations

from pathlib import Path

from ortrain.runtime import ort_profile
from ortrain.runtime.executors.ort import session_options


def test_sessions_profile_with_the_arena_and_plain_ones_without(tmp_path: Path) -> None:
    # Without the arena, the profiler's live allocations kept malloc from reusing the large
    # outputs' blocks: every step faulted them in again and the faults were charged to the
    # kernels (tiny GPT: 406 ms a profiled step against 166).
    plain = session_options()
    assert not plain.enable_cpu_mem_arena and not plain.enable_profiling
    with ort_profile.profiling(tmp_path):
        profiled = session_options()
    assert profiled.enable_profiling and profiled.enable_cpu_mem_arena
    assert profiled.profile_file_prefix == str(tmp_path / "ortrain_session")
    assert not session_options().enable_cpu_mem_arena  # the profile has ended
