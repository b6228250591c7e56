"""Activation checkpointing (``torch.utils.checkpoint``) while capturing.

Default: the checkpointed function is traced into the graphs like any other code, its nodes are
annotated with a region number, and the partitioner is told to recompute them in the backward
graph (``node.meta["recompute"]``, which AOTAutograd's default partitioner honours). So the
computation runs in ONNX Runtime and only the region's inputs cross from forward to backward,
which is the memory saving checkpointing is for.

With ``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1`` (and opaque Functions on), reentrant checkpoints
(``use_reentrant=True``: ``CheckpointFunction``) become python ops run by PyTorch, as upstream
did. Non-reentrant checkpoints are always traced: they are not a ``Function`` there is to run.

Random ops (dropout) and python ops inside a region are saved rather than recomputed: recomputing
them would draw new random numbers or run a user's Function twice.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

from ortrain.capture.function_calls import apply_as_python_op
from ortrain.capture.python_ops import PYTHON_OPS

logger = logging.getLogger("ortrain.capture")

REGION_KEY = "ortrain_checkpoint_region"
ALLOW_VARIABLE = "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT"


# Non-reentrant checkpointing re-runs the forward in the backward pass and stops it with this
# exception once every tensor the backward needs is back: the checkpoint's control flow, which a
# wrapped model run inside ``checkpoint(...)`` must let through untouched (not an ONNX Runtime
# failure for the fallback policy).
RECOMPUTATION_STOPS: tuple[type[Exception], ...] = tuple(
    cls for cls in (getattr(torch_checkpoint, "_StopRecomputationError", None),) if cls is not None
)


class UnsupportedCheckpointError(RuntimeError):
    """A form of checkpointing the traced default cannot reproduce."""


class CheckpointRegions:
    """Intercepts checkpoint calls during one capture and numbers their regions."""

    def __init__(self, *, as_python_ops: bool) -> None:
        self.as_python_ops = as_python_ops
        self._ids = itertools.count()
        self.count = 0

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        self.count += 1
        with fx_traceback.annotate({REGION_KEY: next(self._ids)}):
            yield

    def function_hook(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """For ``intercept_functions``: claims reentrant checkpoints, lets every other call through."""
        if cls is not torch_checkpoint.CheckpointFunction:
            return NotImplemented
        if self.as_python_ops:
            return apply_as_python_op(cls, args, kwargs)
        function, _preserve_rng_state, *inputs = args
        # Reentrant checkpoint gives no gradients when no input requires grad (eager warns so):
        # keep that behaviour rather than silently differ from eager.
        needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        if not needs_grad:
            # Eager's warning too, at each capture: the one hint a LoRA user gets that the adapters
            # inside a checkpointed block of a frozen model do not train (wave 50's review: never
            # shown). It is PyTorch's own check, which warns exactly then.
            torch_checkpoint.check_backward_validity(inputs)
            # Not a recompute region either: its output is a constant of the backward, saved.
            # Recomputed (wave 47's review), it was computed again from the BatchNorm statistics the
            # forward had already updated, and the backward refused them ("modified by an inplace
            # operation").
            with torch.no_grad():
                return function(*inputs)
        with self.region():
            return function(*inputs)

    def _non_reentrant(
        self,
        fn: Callable[..., Any],
        preserve_rng_state: bool = True,
        context_fn: Callable[[], Any] = torch_checkpoint.noop_context_fn,
        determinism_check: str = "default",
        debug: bool = False,
        early_stop: bool = True,
        *args: Any,
        **kwargs: Any,
    ) -> Iterator[None]:
        if context_fn is not torch_checkpoint.noop_context_fn:
            raise UnsupportedCheckpointError(
                "torch.utils.checkpoint with a context_fn (selective checkpointing) cannot be traced "
                f"for recomputation; use use_reentrant=True with {ALLOW_VARIABLE}=1 to run the "
                "checkpointed function in PyTorch"
            )
        with self.region():
            yield

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        original = torch_checkpoint._checkpoint_without_reentrant_generator
        capturing_thread = threading.get_ident()

        # Process-wide patch, per-thread effect: other threads' checkpoints run as usual.
        def generator(*args: Any, **kwargs: Any) -> Iterator[None]:
            chosen = self._non_reentrant if threading.get_ident() == capturing_thread else original
            return chosen(*args, **kwargs)

        torch_checkpoint._checkpoint_without_reentrant_generator = generator  # type: ignore[assignment]
        try:
            yield
        finally:
            torch_checkpoint._checkpoint_without_reentrant_generator = original


def _recomputable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target in PYTHON_OPS:
        return False
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        # An output of a random op with several outputs (``native_dropout``'s values and mask):
        # saved with it. Tagged recomputable, the partitioner re-ran the op in the backward to get
        # it (the op itself cannot be saved: it is a tuple), drawing another mask: a reentrant
        # region that no input needed gradients for (run under no_grad) handed the layers after it
        # other activations than the forward's, and their gradients were wrong (wave 28).
        return _recomputable(node.args[0])
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags


def tag_regions_for_recompute(graph: torch.fx.Graph) -> int:
    """Mark the forward nodes of checkpoint regions for recomputation; returns how many."""
    tagged = 0
    for node in graph.nodes:
        custom = node.meta.get("custom") or {}
        if REGION_KEY not in custom or node.meta.get("partitioner_tag") != "is_forward":
            continue
        if _recomputable(node):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            tagged += 1
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        node.meta["ac_graph_id"] = custom[REGION_KEY]
    return tagged
