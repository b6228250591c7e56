"""The executor protocol: an executor claims FX nodes and builds a runner for a region of them.

The partitioner (:mod:`ortrain.runtime.partitioner`) asks executors, in priority order, which of a
captured graph's nodes they claim, merges each executor's nodes into the largest acyclic regions,
and hands each region, as its own FX ``GraphModule``, to :meth:`Executor.build`. A region's
placeholders are the values it reads from outside and its output is the tuple of values it
produces for others (for a region that is the whole graph: the graph's own outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

Runner = Callable[[list[Any]], list[Any]]


class RegionRejected(Exception):
    """An executor found, while building a region, that it cannot run some of its nodes after all.

    ``reasons`` maps FX node names to why; the partition is redone with those nodes unclaimed.
    """

    def __init__(self, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(f"{name}: {why}" for name, why in reasons.items()))
        self.reasons = reasons


class Executor(Protocol):
    name: str
    # Claimed nodes merge into regions; False gives each claimed node (with the getitems that
    # unpack its results) a region of its own.
    merges: bool

    def claims(self, node: torch.fx.Node) -> bool: ...

    def refusal(self, node: torch.fx.Node) -> str | None:
        """Why this executor does not claim ``node`` (for the log), or None when it does."""
        ...

    def build(self, region: torch.fx.GraphModule, *, what: str, whole: bool) -> Runner:
        """A runner for ``region``; ``whole`` says the region is the entire captured graph."""
        ...


def fx_target_name(node: torch.fx.Node) -> str:
    """``aten.addmm.default`` for an ATen node; the function's name otherwise."""
    return fx_target_name_of(node.target)


def fx_target_name_of(target: object) -> str:
    return str(target) if hasattr(target, "_schema") else getattr(target, "__name__", str(target))
