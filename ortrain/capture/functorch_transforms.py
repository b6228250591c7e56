"""Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...) is running.

Under such a transform the model's inputs and parameters are functorch's wrapper tensors (batched
or gradient-tracking views with no storage of their own), which no captured graph can take:
ORTModule then runs the model in PyTorch (``ortmodule.py``), and the transform gets eager
PyTorch's answer (per-sample gradients for differential privacy, Jacobians, ...).
"""

from __future__ import annotations

import torch


def functorch_transform_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def any_batched(tensors: object) -> bool:
    """Whether any of ``tensors`` is a vmap batched tensor, which has no storage of its own:
    ``autograd.grad(..., is_grads_batched=True)`` hands a backward such gradients (through
    PyTorch's older vmap, which leaves functorch's interpreter stack empty)."""
    return any(
        isinstance(t, torch.Tensor) and not torch._C._has_storage(t)
        for t in tensors  # type: ignore[attr-defined]
    )
