"""Gradients left behind by a parameter's ``.data`` being replaced, set aside while a capture traces.

``p.data = torch.cat([p.data, new_rows])`` (a layer grown between steps) leaves ``p.grad`` at the
old size until the next ``zero_grad()``. Eager PyTorch does not read it in the forward, but a
capture turns every parameter into a fake tensor, gradient included, and that failed ("attempting
to assign a gradient of size [16, 16] to a tensor of size [20, 16]"): the model went to the
fallback and trained in PyTorch for good. Such gradients are set aside while tracing and put back
as they were, so ``zero_grad()`` or PyTorch's own error at the next backward sees them as eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


def _is_stale(tensor: torch.Tensor) -> bool:
    grad = tensor.grad
    return grad is not None and (grad.shape != tensor.shape or grad.dtype != tensor.dtype)


@contextmanager
def stale_gradients_set_aside(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    stale = [(t, t.grad) for t in tensors if _is_stale(t)]
    for tensor, _ in stale:
        tensor.grad = None
    try:
        yield
    finally:
        for tensor, grad in stale:
            # PyTorch checks a gradient against its tensor only when it is assigned: assign it
            # (over any the trace made) while the tensor has the gradient's shape, as it had when
            # the gradient was made.
            data = tensor.data
            tensor.data = torch.empty_like(grad)
            tensor.grad = grad
            tensor.data = data
