"""Memory held at each phase of a training step: the process, and PyTorch's device allocator.

ONNX Runtime does not expose its allocators' statistics through its Python API (the C API's
``AllocatorGetStats`` has no binding), so on the CPU the process figures are the whole picture:
ortrain's sessions allocate through malloc, without an arena (see
``ortrain.runtime.executors.ort``), and their memory is part of the process's resident set. On
CUDA, PyTorch's allocator figures are reported beside it.

Only the last :data:`WINDOW` steps are kept as records (``records``, for plotting; set ``window``
to keep more or fewer); every step counts in each phase's peak (``peaks``), which is what the
summary at the end shows. Until wave 52 every step was kept, and a long run grew without bound.
"""

from __future__ import annotations

import logging
import resource
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("ortrain.inspector")

PHASES = ("before forward", "after forward", "after backward")
WINDOW = 1000  # steps kept as records; older steps count in the peaks only
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
class PhasePeak:
    """The highest figures one phase reached over every step recorded."""

    phase: str
    steps: int = 0
    process_current_mib: float = 0.0
    step: int = 0  # the step of the highest process_current_mib
    process_peak_mib: float = 0.0
    device_current_mib: float | None = None
    device_peak_mib: float | None = None

    def add(self, r: MemoryRecord) -> None:
        self.steps += 1
        if self.steps == 1 or r.process_current_mib > self.process_current_mib:
            self.process_current_mib, self.step = r.process_current_mib, r.step
        self.process_peak_mib = max(self.process_peak_mib, r.process_peak_mib)
        self.device_current_mib = _highest(self.device_current_mib, r.device_current_mib)
        self.device_peak_mib = _highest(self.device_peak_mib, r.device_peak_mib)


class MemoryStats:
    """Per-phase memory records of the last ``window`` steps, and each phase's peak over all steps;
    each step's three phases are logged as one table."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._recent: deque[MemoryRecord] = deque()
        self._this_step: list[MemoryRecord] = []  # the phases of the step being recorded, logged at its end
        self.peaks: dict[str, PhasePeak] = {}

    @property
    def records(self) -> list[MemoryRecord]:
        """The records of the last ``window`` steps, oldest first."""
        return list(self._recent)

    def record(self, step: int, phase: str, device: torch.device | None = None) -> MemoryRecord:
        current, peak = process_memory_mib()
        device_current = device_peak = None
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            device_current = torch.cuda.memory_allocated(device) / _MIB
            device_peak = torch.cuda.max_memory_allocated(device) / _MIB
        entry = MemoryRecord(step, phase, current, peak, device_current, device_peak)
        self._recent.append(entry)
        while self._recent and self._recent[0].step <= step - self.window:
            self._recent.popleft()
        self.peaks.setdefault(phase, PhasePeak(phase)).add(entry)
        self._this_step = [r for r in self._this_step if r.step == step] + [entry]
        if phase == PHASES[-1]:
            logger.info("memory at step %d (MiB)\n%s", step, self.table(self._this_step))
            self._this_step = []
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

    def summary(self) -> str:
        """Each phase's peak over every step recorded (what is logged at the end), in MiB."""
        lines = [
            "| phase | steps | process current, highest | at step | process peak | device current, "
            "highest | device peak |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for phase in sorted(self.peaks, key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES)):
            p = self.peaks[phase]
            lines.append(
                f"| {p.phase} | {p.steps} | {p.process_current_mib:.1f} | {p.step} | "
                f"{p.process_peak_mib:.1f} | {_mib(p.device_current_mib)} | {_mib(p.device_peak_mib)} |"
            )
        return "\n".join(lines)


def _highest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
