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
