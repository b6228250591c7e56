"""The memory optimizer's reports of an ``ORTModule``, as data (the summary logs them at INFO)."""

from __future__ import annotations

from ortrain.capture.memory_optimizer import MemoryReport
from ortrain.ortmodule.ortmodule import ORTModule


def memory_reports(model: ORTModule) -> list[MemoryReport]:
    """One report per training capture so far, oldest first (a capture per input signature)."""
    return [
        entry.capture.memory_report
        for entries in model._ortrain_graphs.values()
        for entry in entries
        if entry.capture.memory_report is not None
    ]
