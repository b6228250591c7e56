"""Where a first step's time goes: capture, partition, export, passes, session creation.

Each stage is logged at DEBUG on ``ortrain.startup`` and appended to :data:`RECORDED`, which
``benchmarks/bench_startup.py`` reads; nothing else depends on it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger("ortrain.startup")


@dataclass(frozen=True)
class StageTiming:
    stage: str  # "capture", "partition", "export", "export (cached)", "passes", "session"
    graph: str  # "forward", "backward", a segment's name, or "" for the whole capture
    seconds: float


# Bounded: a long run that re-captures now and then must not grow it without end.
RECORDED: deque[StageTiming] = deque(maxlen=1000)


@contextlib.contextmanager
def timed(stage: str, graph: str = "") -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        RECORDED.append(StageTiming(stage, graph, seconds))
        logger.debug("%s%s: %.3f s", stage, f" of the {graph} graph" if graph else "", seconds)
