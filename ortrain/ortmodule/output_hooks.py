"""Gradient hooks on an output the model also uses inside its forward: refused at the backward.

See :mod:`ortrain.capture.internal_outputs` for why such a hook cannot see, or change, the
gradient eager PyTorch gives it. The hook is registered after the call returns, so the check
runs when the backward reaches the captured graph's node (a pre-hook on it): a tensor hook of
the user's on one of those outputs raises there, before any gradient lands in a parameter. A
``retain_grad()`` on it keeps the documented partial ``.grad`` (README, *Gradients of a returned
intermediate*).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch


def refuse_hooks_on_outputs_used_inside(outputs: Sequence[Any], positions: frozenset[int]) -> None:
    """Watch ``outputs[i]`` for ``i`` in ``positions`` (outputs the forward also reads)."""
    if not positions or not torch.is_grad_enabled():
        return
    watched = [
        (i, weakref.ref(outputs[i]))
        for i in sorted(positions)
        if i < len(outputs) and isinstance(outputs[i], torch.Tensor) and outputs[i].grad_fn is not None
    ]
    if not watched:
        return

    def check(grad_outputs: Any) -> None:
        for i, ref in watched:
            tensor = ref()
            if tensor is not None and tensor._backward_hooks:
                raise RuntimeError(
                    f"a gradient hook on output {i} of an ORTModule call, a tensor the model's forward "
                    "also uses itself: in eager PyTorch the hook sees, and may change, the gradient "
                    "from both its uses, inside the model and outside; the captured graph is one "
                    "autograd node, which gives the hook only the outside part (as torch.compile "
                    "does), so the layers below it would get a different gradient. Register the "
                    "hook inside the forward (`h.register_hook(...)` there: ortrain then runs the "
                    "model through graph breaks, in PyTorch where needed), use a custom "
                    "autograd.Function there for gradient reversal, or call `wrapped.module(...)` "
                    "for this step"
                )

    for node in {id(t.grad_fn): t.grad_fn for _, ref in watched if (t := ref()) is not None}.values():
        node.register_prehook(check)
