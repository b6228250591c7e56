"""``torch.compile(model, backend="ortrain")``: TorchDynamo splits, ortrain trains each graph.

The second entry point next to :class:`ortrain.ORTModule`. TorchDynamo captures the model as one
or more graphs with Python in between (at ``.item()``, ``.tolist()``, value-driven ``if``\\s) and
guards them; every graph goes through ortrain's pipeline (AOTAutograd capture with ortrain's
settings, ONNX export, passes, executors). ``ORTModule`` uses this backend by itself for a model
whose whole-graph capture fails on data-dependent Python.

Options are ``ORTModule``'s: the ``ORTMODULE_*`` variables (read when a graph is compiled) and,
through :class:`OrtrainBackend`, ``DebugOptions``::

    compiled = torch.compile(model, backend="ortrain")
    compiled = torch.compile(model, backend=OrtrainBackend(DebugOptions(save_onnx=True, onnx_prefix="m")))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ortrain.capture.dynamo_backend import BACKEND_NAME, aot_backend, register
from ortrain.capture.memory_optimizer import MemoryOptimizerConfig
from ortrain.ortmodule.log_output import configure_log_output
from ortrain.ortmodule.options import (
    DebugOptions,
    RuntimeOptions,
    openmp_wait_policy,
    python_log_level,
    runtime_options,
    user_malloc_setting,
)
from ortrain.passes.pipeline import StageSaver, default_passes
from ortrain.runtime.freed_memory_reuse import reuse_freed_memory
from ortrain.runtime.full_collections import compile_garbage_collected
from ortrain.runtime.placement import memory_level_declined
from ortrain.runtime.placement_tuning import TuningSettings, build_tuned_graph_executor

logger = logging.getLogger("ortrain.backend")

__all__ = ["OrtrainBackend", "ortrain_backend"]


class OrtrainBackend:
    """A TorchDynamo backend that trains each graph on ONNX Runtime through ortrain's pipeline."""

    def __init__(self, debug_options: DebugOptions | None = None, options: RuntimeOptions | None = None):
        self.debug_options = (debug_options or DebugOptions()).with_environment()
        self.options = options
        self.graphs_compiled = 0  # Dynamo graphs handed to this backend
        self._memory_warned: set[str] = set()  # the memory optimizer's warnings, once per backend
        # As ORTModule does: DebugOptions(log_level=...) and ORTMODULE_LOG_LEVEL set the level, and
        # ortrain's lines get their prefix (wave 42: on this path neither, and warnings came out
        # through Python's last-resort handler).
        prints = options or runtime_options()
        configure_log_output(
            python_log_level(self.debug_options.log_level),
            inspector_prints=prints.print_input_density or prints.print_memory_stats,
        )

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any
    ) -> Callable[..., Any]:
        options = self.options or runtime_options()
        reuse_freed_memory(options.reuse_freed_memory, user_malloc_setting())
        self.graphs_compiled += 1
        device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        if device.type != "cpu":
            raise RuntimeError(f"ortrain runs on the CPU execution provider; got a graph on {device}")

        def compile_graph(graph: torch.fx.GraphModule, name: str, number: int) -> Any:
            # The backward graph is built at the first backward, after the call below returned.
            with compile_garbage_collected():
                return _graph_runner(graph, name, number, options, self.debug_options, device)

        memory = MemoryOptimizerConfig(
            options.memory_opt_level, options.memory_opt_config, warned=self._memory_warned
        )
        # As ORTModule's compile: no full collection of the whole process while AOTAutograd
        # traces and the forward is exported, and one of the compile's own objects after it.
        with compile_garbage_collected():
            return aot_backend(gm, example_inputs, compile_graph, memory)


def _graph_runner(
    graph: torch.fx.GraphModule,
    name: str,
    number: int,
    options: RuntimeOptions,
    debug: DebugOptions,
    device: torch.device,
) -> Any:
    """The one place the backend builds a runner: the same function ORTModule's graphs go through."""
    saver = None
    if debug.save_onnx:
        prefix = f"{debug.onnx_prefix}_dynamo{number}" if debug.onnx_prefix else f"dynamo{number}"
        saver = StageSaver(debug.save_path, prefix, "training" if torch.is_grad_enabled() else "inference")
    logger.debug("building the %s graph of Dynamo graph %d", name, number)
    return build_tuned_graph_executor(
        graph,
        name=name,
        settings=TuningSettings.of(options),
        opset_version=options.opset_version,
        passes=default_passes(compute_optimizer=options.enable_compute_optimizer),
        saver=saver,
        device=device,
        policy=options.fallback_policy,
        openmp_passive=openmp_wait_policy() == "PASSIVE",
        cache_dir=options.cache_dir,
        declined=memory_level_declined(options.memory_opt_level, name),
    )


def ortrain_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
) -> Callable[..., Any]:
    """The backend ``torch.compile(backend="ortrain")`` resolves to (also the entry point's target)."""
    return OrtrainBackend()(gm, example_inputs, **kwargs)


register(BACKEND_NAME, ortrain_backend)
