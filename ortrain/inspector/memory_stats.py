"""Memory held at each phase of a training step: the process, and PyTorch's device allocator.

ONNX Runtime does not expose its allocators' statistics through its Python API (the C API's
``AllocatorGetStats`` has no binding), so on the CPU the process figures are the whole picture:
ortrain's sessions allocate through malloc, without an arena (see
``ortrain.runtime.executors.ort``), and their memory is part of the process's resident set. On
CUDA, PyTorch's allocator figures are reported beside it.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("ortrain.inspector")

PHASES = ("before forward", "after forward", "after backward")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryRecord:
    step: int
    phase: str
    process_current_mib: float
    process_peak_mib: float
    device_current_mib: float | None  # torch.cuda.memory_allocated; None on the CPU
    device_peak_mib: float | None


def process_memory_mib() -> tuple[float, float]:
    """The process's resident set now and at its peak, in MiB."""
    current = peak = 0.0
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    if not peak:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return current, peak


@dataclass
class MemoryStats:
    """Per-phase memory records; each step's three phases are logged as one table."""

    records: list[MemoryRecord] = field(default_factory=list)

    def record(self, step: int, phase: str, device: torch.device | None = None) -> MemoryRecord:
        current, peak = process_memory_mib()
        device_current = device_peak = None
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            device_current = torch.cuda.memory_allocated(device) / _MIB
            device_peak = torch.cuda.max_memory_allocated(device) / _MIB
        entry = MemoryRecord(step, phase, current, peak, device_current, device_peak)
        self.records.append(entry)
        if phase == PHASES[-1]:
            logger.info(
                "memory at step %d (MiB)\n%s", step, self.table([r for r in self.records if r.step == step])
            )
        return entry

    def table(self, records: list[MemoryRecord] | None = None) -> str:
        rows = self.records if records is None else records
        lines = [
            "| step | phase | process current | process peak | device current | device peak |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r.step} | {r.phase} | {r.process_current_mib:.1f} | {r.process_peak_mib:.1f} | "
                f"{_mib(r.device_current_mib)} | {_mib(r.device_peak_mib)} |"
            )
        return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
