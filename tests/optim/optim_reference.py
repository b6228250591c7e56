"""Independent reference of the FusedAdam update, written from the formulas in the issue (float64 math)."""

from __future__ import annotations

import math

import torch


def adam_formula_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    mode: int,
    bias_correction: bool = True,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of AdamWMode ``mode``, computed in ``dtype``; returns new (p, m, v)."""
    p, g, m, v = (t.to(dtype) for t in (p, g, m, v))
    b1, b2 = betas
    bc1 = 1 - b1**step if bias_correction else 1.0
    bc2 = 1 - b2**step if bias_correction else 1.0
    if mode == 0:
        g = g + weight_decay * p
    if mode == 2:
        p = p * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    if mode == 1:
        p = p - lr * (math.sqrt(bc2) / bc1) * m / (v.sqrt() + eps)
        p = p - lr * weight_decay * p
    else:
        p = p - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v
