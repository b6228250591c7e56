"""The runtime inspector an ``ORTModule`` carries as ``model.inspector``.

``ORTMODULE_PRINT_INPUT_DENSITY=1`` records, every training step, the density of the inputs that
feed embeddings and losses (see :mod:`ortrain.inspector.input_density`);
``ORTMODULE_PRINT_MEMORY_STATS=1`` records memory before the forward graph, after it and after
the backward graph (see :mod:`ortrain.inspector.memory_stats`). Both log tables through the
``ortrain.inspector`` logger at INFO and keep the figures of the last steps as data for plotting;
the summary at the end is one row an input (lowest, mean and highest density) and one a phase
(its peak), however many steps ran.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ortrain.capture.aot_capture import Capture, GraphSlot
from ortrain.inspector.input_density import DensitySource, InputDensity, find_density_sources
from ortrain.inspector.memory_stats import PHASES, MemoryStats

logger = logging.getLogger("ortrain.inspector")


def input_names(spec: Any, forward: Callable[..., Any]) -> list[str]:
    """A readable name for each flat input: ``input_ids``, ``batch['labels']``, ``args[0]``."""
    try:
        parameters = [
            p.name
            for p in inspect.signature(forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        parameters = []
    names: list[str] = []

    def walk(node: Any, name: str) -> None:
        kind = node[0]
        if kind == "tensor":
            names.append(name)
        elif kind in ("tuple", "list", "namedtuple"):
            for i, child in enumerate(node[-1]):
                walk(child, f"{name}[{i}]")
        elif kind in ("dict", "model_output", "dataclass", "object", "distribution"):
            for key, child in zip(node[2], node[3], strict=True):
                walk(child, f"{name}[{key!r}]" if kind == "dict" else f"{name}.{key}")
        elif kind == "pytree":
            for i, child in enumerate(node[3]):
                walk(child, f"{name}[{i}]")

    args_spec, kwargs_spec = spec[2]
    for i, child in enumerate(args_spec[2]):
        walk(child, parameters[i] if i < len(parameters) else f"args[{i}]")
    for key, child in zip(kwargs_spec[2], kwargs_spec[3], strict=True):
        walk(child, str(key))
    return names


class RuntimeInspector:
    """Input density and memory figures of one ``ORTModule``, as tables in the log and as data."""

    def __init__(self, *, print_input_density: bool, print_memory_stats: bool) -> None:
        self.print_input_density = print_input_density
        self.print_memory_stats = print_memory_stats
        self.input_density = InputDensity()
        self.memory_stats = MemoryStats()
        self.step = 0
        # By id of the capture, each entry dropped when its capture goes (the graph cache evicted
        # it): until wave 52 they stayed, one a graph ever captured.
        self._sources: dict[int, list[DensitySource]] = {}
        self._finished_at: int | None = None  # the step the summary was logged at
        self._device: torch.device | None = None

    @property
    def enabled(self) -> bool:
        return self.print_input_density or self.print_memory_stats

    def attach(self, captured: Capture, device: torch.device) -> None:
        """Learn what ``captured`` reads, and time its graphs' runs for the memory phases."""
        self._device = device
        if self.print_input_density:
            trace = captured.forward_trace
            sources = (
                []
                if trace is None
                else find_density_sources(trace.graph_module.graph, trace.input_placeholders)
            )
            if trace is None:
                logger.info("input density: the forward graph could not be traced; no density figures")
            self._sources[id(captured)] = sources
            weakref.finalize(captured, self._sources.pop, id(captured), None).atexit = False
        if self.print_memory_stats and captured.training:
            self._wrap(captured.forward, before=PHASES[0], after=PHASES[1])
            if captured.backward is not None:
                self._wrap(captured.backward, before=None, after=PHASES[2])

    def _wrap(self, slot: GraphSlot, *, before: str | None, after: str) -> None:
        run = slot.runner

        def inspected(args: list[Any]) -> list[Any]:
            if before is not None:
                self.memory_stats.record(self.step, before, self._device)
            outputs = run(args) if run is not None else slot.graph(*args)
            self.memory_stats.record(self.step, after, self._device)
            return outputs

        slot.runner = inspected

    def on_forward(
        self, captured: Capture, spec: Any, forward: Callable[..., Any], inputs: list[torch.Tensor]
    ) -> None:
        """Called before each run of ``captured``: counts training steps and measures the inputs."""
        if not captured.training:
            return
        self.step += 1
        sources = self._sources.get(id(captured))
        if self.print_input_density and sources:
            self.input_density.record(self.step, sources, input_names(spec, forward), inputs)

    def finish(self) -> None:
        """Log what was not printed yet and the summaries (called when the model goes away or the
        process ends); again only after more steps."""
        if self._finished_at == self.step:
            return
        self._finished_at = self.step
        if self.print_input_density and self.input_density.totals:
            self.input_density.log(f"input density up to step {self.step}")
            logger.info("input density, all steps\n%s", self.input_density.summary())
        if self.print_memory_stats and self.memory_stats.peaks:
            logger.info("memory, all steps: each phase's peak (MiB)\n%s", self.memory_stats.summary())
