"""ORTModule's second path: a model whose whole-graph capture fails on data-dependent Python.

``.item()``, ``.tolist()``, ``if mask.any():`` and sizes computed from values cannot be captured as
one graph. For such a model ORTModule hands the wrapped module to ``torch.compile`` with ortrain's
backend (:mod:`ortrain.backend`): TorchDynamo splits it into graphs with Python in between and
guards them, and each graph trains through ortrain's pipeline. Whole-graph capture stays the
first choice: it starts faster and has no guards of Dynamo's to evaluate at each step.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ortrain.capture.data_assignments import IN_PLACE_ADVICE
from ortrain.capture.distribution_validation import distribution_checks_off
from ortrain.capture.dynamo_backend import (
    backend_failure,
    dynamo_trace_failure,
    graph_breaks_reported,
    hooks_guarded,
    in_control_flow_operator,
    is_data_dependent,
    module_ints_symbolic,
    on_sparse_tensors,
    reads_outside_tensors,
    recompile_limit_watched,
    source_line,
)
from ortrain.capture.dynamo_regions import close_region, open_region
from ortrain.capture.outer_checkpoint import recompute_in_full
from ortrain.ortmodule.backward_under_autocast import watch_for_backward_under_autocast
from ortrain.ortmodule.create_graph import GRAPH_BREAKS, watch_for_create_graph
from ortrain.ortmodule.eager_check import run_eagerly_leaving_no_trace
from ortrain.ortmodule.fallback import ORTModuleFallbackException, ORTModuleTorchModelException
from ortrain.ortmodule.guards import global_hook_ids
from ortrain.ortmodule.options import DebugOptions, RuntimeOptions

logger = logging.getLogger("ortrain.ortmodule")

__all__ = [
    "GraphBreakPath",
    "in_control_flow_operator",
    "is_data_dependent",
    "on_sparse_tensors",
    "reads_outside_tensors",
]


# How many GraphBreakPath calls are running: TorchDynamo tracing an ORTModule nested in the model
# is then ortrain's own doing, not a torch.compile of the user's (a plain global: Dynamo reads it
# as a constant while it traces the nested wrapper's forward).
_calls_running = [0]


def inside_graph_break_path() -> bool:
    """Whether ortrain's own graph-break path is running (TorchDynamo traces for it)."""
    return _calls_running[0] > 0


class GraphBreakPath:
    """``torch.compile(module, backend=ortrain)`` with one INFO line per graph break."""

    def __init__(self, module: nn.Module, debug: DebugOptions, options: RuntimeOptions) -> None:
        # ortrain.backend imports ortrain.ortmodule (options): import it when first needed.
        from ortrain.backend import OrtrainBackend

        self.backend = OrtrainBackend(debug, options)
        self.module = module
        self.policy = options.fallback_policy
        self.breaks: list[tuple[str, int, str]] = []
        # Code whose graph ortrain failed to capture, which TorchDynamo runs in eager PyTorch.
        self.eager_regions: list[str] = []
        self._compile()

    def _compile(self) -> None:
        # Each ORTModule's TorchDynamo entries apart from other instances', dropped with it: see
        # capture/dynamo_regions.py.
        with distribution_checks_off():  # torch.compile turns them off for good: put back
            self.compiled = torch.compile(
                self.module, backend=self.backend, fullgraph=False, isolate_recompiles=True
            )
        self._close = weakref.finalize(self, close_region, open_region(self.compiled))
        # TorchDynamo traces the global module hooks registered when it compiles and does not
        # guard them: one registered later never ran (wave 42: a global forward hook doubling
        # every Linear's output was ignored, losses and gradients those of the model without it).
        self.global_hooks = global_hook_ids()

    @property
    def graph_count(self) -> int:
        """Graphs Dynamo handed to ortrain so far (recompilations included)."""
        return self.backend.graphs_compiled

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if global_hook_ids() != self.global_hooks:
            logger.info("the global module hooks changed: TorchDynamo traces the model again")
            self._close()
            self._compile()
        if not recompute_in_full():
            # A checkpoint's recompute that stops early skips what runs after the graphs' saves
            # (their buffer writes, Dynamo's replayed side effects): see capture/outer_checkpoint.py.
            raise RuntimeError(
                "a non-reentrant torch.utils.checkpoint around an ORTModule whose model trains "
                "through TorchDynamo's graph breaks must recompute without early stop, which "
                "ortrain could not switch off in this PyTorch: pass early_stop=False to "
                "checkpoint(...), or use use_reentrant=True"
            )
        watched = recompile_limit_watched(self._limit_reached)
        reported = graph_breaks_reported(self._report)
        with reported, hooks_guarded(), watched, distribution_checks_off(), module_ints_symbolic():
            _calls_running[0] += 1
            try:
                outputs = self.compiled(*args, **kwargs)
            except Exception as error:
                # Dynamo wraps what the backend raised; ORTModule's fallback policy judges ours.
                inner = backend_failure(error)
                if isinstance(inner, ORTModuleFallbackException):
                    raise inner from error
                if inner is not None:  # AOTAutograd's capture of a graph failed
                    raise ORTModuleTorchModelException(
                        f"capture of a graph between graph breaks failed: {_described(inner)}"
                    ) from error
                if dynamo_trace_failure(error):
                    # TorchDynamo's own trace of an operator failed where eager runs it (a uint8
                    # mask after a bool one: "tensors used as indices must be long, int, byte or
                    # bool", wave 47's review): the fallback policy judges it like a failed
                    # capture. Where eager fails too (a bad batch), eager's error is the user's,
                    # and the model keeps its graphs (the review of wave 47's diff: one caught
                    # shape error sent the model to PyTorch for good).
                    run_eagerly_leaving_no_trace(self.module, args, kwargs)
                    explained = str(error).split("\n  Hint:")[0]  # then pages of torch.compile's advice
                    raise ORTModuleTorchModelException(
                        f"TorchDynamo failed to trace the forward: {type(error).__name__}: {explained}"
                    ) from error
                raise
            finally:
                _calls_running[0] -= 1
        # AOTAutograd's graphs cannot be differentiated twice: a gradient penalty hears why at its
        # first backward, as on the whole-graph path (wave 42: only torch.compile's own error).
        watch_for_create_graph(pytree.tree_leaves(outputs), GRAPH_BREAKS)
        if torch._C._is_any_autocast_enabled():
            watch_for_backward_under_autocast(pytree.tree_leaves(outputs))
        if self.eager_regions and not self.policy & ORTModuleTorchModelException.policy:
            # Under a policy without FALLBACK_UNSUPPORTED_TORCH_MODEL such code is an error, at
            # every call (until wave 42 a warning, and the code trained in PyTorch).
            raise ORTModuleTorchModelException(
                f"{self.eager_regions[0]}; ORTMODULE_FALLBACK_POLICY without "
                "FALLBACK_UNSUPPORTED_TORCH_MODEL (in the default policy) forbids that"
            )
        return outputs

    def _report(self, file: str, line: int, reason: str, eager: bool) -> None:
        if (file, line, reason) in self.breaks:
            return
        self.breaks.append((file, line, reason))
        # A break of TorchDynamo's own is how such a model trains (INFO); a graph that ortrain
        # failed to capture trains in PyTorch, which the user should hear of once.
        if eager:
            self.eager_regions.append(f"graph break at {file}:{line}: {reason}")
        level = logging.WARNING if eager else logging.INFO
        logger.log(level, "graph break at %s:%d `%s`: %s", file, line, source_line(file, line), reason)

    def _limit_reached(self, notice: str) -> None:
        region = (
            f"{notice}: TorchDynamo runs that function in eager PyTorch from now on, for the modes "
            "it has no graph of (each train/eval, grad mode and flag argument needs one)"
        )
        if region not in self.eager_regions:
            self.eager_regions.append(region)
            logger.warning("%s", region)


def _described(error: BaseException) -> str:
    """The error, led by what to change where its own text does not say (AOTAutograd's assertions)."""
    text = f"{type(error).__name__}: {error}"
    if "set_ on a graph input" in text:
        # TorchDynamo traced `p.data = value` as a set_ (MoCo's momentum encoder)
        return f"the forward assigns `tensor.data = value`: {IN_PLACE_ADVICE} ({text.splitlines()[0]})"
    return text
