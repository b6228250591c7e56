"""DeepSpeed ZeRO stage 3 under ORTModule: the wrapper gathers the partitioned parameters itself.

ZeRO-3 keeps a 1/N shard of each parameter on each rank and gathers a submodule's parameters in
hooks of that submodule, around its forward and, through autograd Functions on its outputs, its
backward. Under ORTModule the submodules do not run (ONNX Runtime runs the captured graph) and
their hooks cannot be traced. So, when the model's parameters are ZeRO-3 parameters:

- every parameter still partitioned is all-gathered before the forward graph runs (and before a
  capture, during which DeepSpeed's hooks on the wrapped submodules are set aside), and
  partitioned again after it;
- an autograd Function on the outputs gathers them again before the backward graph runs, and they
  are partitioned when the backward pass ends;
- the gradients reach DeepSpeed through its own per-parameter hooks, which reduce-scatter them as
  in eager mode.

The cost: during each forward and backward, all the parameters are whole on every rank at once
(eager ZeRO-3 gathers one submodule at a time, with prefetching); between steps, parameters,
gradients and optimizer state stay partitioned.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ortrain.capture.module_hooks import at_end_of_backward, hooks_set_aside
from ortrain.ortmodule.schema import flatten_outputs, unflatten

logger = logging.getLogger("ortrain.ortmodule")


def zero3_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 partitioned (they carry ``ds_status``); usually none."""
    if "deepspeed" not in sys.modules:  # asked at every forward: no DeepSpeed, no walk
        return []
    return [p for p in module.parameters() if hasattr(p, "ds_status")]


def _is_deepspeed_hook(hook: Any) -> bool:
    return getattr(hook, "__module__", "").startswith("deepspeed.")


def _not_available(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.ds_status.name == "NOT_AVAILABLE"]


def _gather(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """All-gather the parameters still partitioned; returns them (for :func:`_release`)."""
    absent = _not_available(params)
    if absent:
        absent[0].all_gather(param_list=absent)
    return absent


def _release(params: list[nn.Parameter]) -> None:
    # Leave alone what DeepSpeed keeps whole (persistent) or still uses in a submodule it runs.
    done = [
        p
        for p in params
        if p.ds_status.name == "AVAILABLE"
        and not getattr(p, "ds_persist", False)
        and not getattr(p, "ds_active_sub_modules", None)
    ]
    if done:
        done[0].partition(param_list=done)


class _GatherForBackward(torch.autograd.Function):
    """Identity on the outputs; its backward gathers the parameters for the backward graph."""

    @staticmethod
    def forward(ctx: Any, params: list[nn.Parameter], *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.params = params
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        gathered = _gather(ctx.params)
        if gathered:
            at_end_of_backward(lambda: _release(gathered))
        return (None, *grads)


@contextlib.contextmanager
def zero3_gathered(module: nn.Module, params: list[nn.Parameter]) -> Iterator[Callable[[Any], Any]]:
    """Run ORTModule's forward inside: parameters whole, DeepSpeed's submodule hooks set aside.

    Yields the function to apply to the forward's outputs (it gathers again for the backward).
    """
    gathered = _gather(params)
    try:
        with hooks_set_aside(module, _is_deepspeed_hook):
            yield lambda outputs: _gather_for_backward(params, outputs)
    finally:
        _release(gathered)


def _gather_for_backward(params: list[nn.Parameter], outputs: Any) -> Any:
    flat, spec = flatten_outputs(outputs)
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions or not torch.is_grad_enabled():
        return outputs
    passed = _GatherForBackward.apply(params, *(flat[i] for i in positions))
    for i, tensor in zip(positions, passed, strict=True):
        flat[i] = tensor
    return unflatten(spec, flat)
