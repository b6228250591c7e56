"""A ``Gelu`` Function that differs from ``_functions_a.Gelu``: the sigmoid approximation, x·σ(1.702x)."""

from __future__ import annotations

import torch


class Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        s = torch.sigmoid(1.702 * x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, s = ctx.saved_tensors
        return grad * (s + 1.702 * x * s * (1 - s))
