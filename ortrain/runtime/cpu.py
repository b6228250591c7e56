"""The CPU this process runs on, as benchmarks and tuning results name it."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_name() -> str:
    """The ``model name`` of /proc/cpuinfo ("AMD EPYC", "Intel(R) Xeon(R) ..."), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
