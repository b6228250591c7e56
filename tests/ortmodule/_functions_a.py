"""A ``Gelu`` Function; ``_functions_b`` defines another class of the same name (name-clash test)."""

from __future__ import annotations

import torch


class Gelu(torch.autograd.Function):
    """Exact GELU with a hand-written backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1.0 + torch.erf(x / 2.0**0.5))
        pdf = torch.exp(-0.5 * x * x) / (2.0 * torch.pi) ** 0.5
        return grad * (cdf + x * pdf)
