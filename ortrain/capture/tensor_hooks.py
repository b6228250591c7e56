"""Gradient hooks that a forward registers on its tensors: ``h.register_hook(fn)``,
``h.retain_grad()``, ``p.register_post_accumulate_grad_hook(fn)``,
``torch.autograd.graph.register_multi_grad_hook``.

Such a hook belongs to the autograd graph of one call: it runs in that call's backward. A
captured graph registered it once, on a traced tensor, and its backward never ran it: a
gradient-reversal or gradient-scaling hook on an activation was silently ignored (wave 29: the
gradients were 0.2 off from the first step), a Grad-CAM hook never saw a gradient, and a
retained activation's ``.grad`` stayed ``None``. TorchDynamo breaks the graph at such a call and
registers the hook on the real tensor at every step, as eager PyTorch does.

So capture runs with these methods watched, and a capture during which the user's forward
registered one on a tensor that requires a gradient is refused with :class:`TensorHookError`:
the model then trains through TorchDynamo's graph breaks. A call on a tensor that requires no
gradient goes through (eager PyTorch's own error, or nothing to do), and so do calls outside the
user's forward (PyTorch's own machinery).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ortrain.capture.generator_resets import in_user_forward

_METHODS = ("register_hook", "register_post_accumulate_grad_hook", "retain_grad")


class TensorHookError(RuntimeError):
    """The forward registered a gradient hook on a tensor while it was captured."""


@contextlib.contextmanager
def refusing_tensor_hooks() -> Iterator[None]:
    """Raise :class:`TensorHookError` if a user forward run by the body registered a gradient
    hook on a tensor that requires a gradient (the body's own error, if any, is its cause)."""
    called: list[str] = []

    def watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if in_user_forward() and tensor.requires_grad:
                called.append(f"Tensor.{name}")
                # Stop the trace here: the hook must not run on traced gradients either.
                raise TensorHookError(f"the forward calls Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return call

    # retain_grad is inherited from the C class: set on torch.Tensor, then deleted again.
    originals = {name: torch.Tensor.__dict__.get(name) for name in _METHODS}
    for name in _METHODS:
        setattr(torch.Tensor, name, watched(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        if called:
            raise TensorHookError(
                f"the forward registers a gradient hook on a tensor ({', '.join(dict.fromkeys(called))}): "
                "a captured graph would register it once, on a traced tensor, and its backward would "
                "never run it"
            )
