"""``F.interpolate(x, scale_factor=s)`` whose output keeps the input's size is a copy, as eager's.

With ``1 < s < (n + 1) / n`` the output size ``floor(n * s)`` is ``n``: eager PyTorch's CPU
kernels for ``nearest``, ``linear``, ``bilinear`` and ``trilinear`` then copy the input and ignore
the scale, while the decomposition a capture traces maps each output coordinate by ``1 / s``,
interpolating for real (wave 47's review: DINO's "+0.1" scale on a 6 x 6 map, a loss of -12.9 for
eager's -4.2, silently; ``torch.compile`` does the same). Written as eager's kernels compute it.
(Bicubic interpolates at that size in eager's forward, and its backward copies: left as it is.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F

_COPYING_MODES = ("nearest", "linear", "bilinear", "trilinear")


def _interpolate(
    input: torch.Tensor,
    size: Any = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Any:
    if size is not None or scale_factor is None or recompute_scale_factor or antialias:
        return NotImplemented
    if mode not in _COPYING_MODES or not isinstance(input, torch.Tensor) or input.dim() < 3:
        return NotImplemented
    spatial = input.shape[2:]
    scales = [scale_factor] * len(spatial) if isinstance(scale_factor, int | float) else list(scale_factor)
    if len(scales) != len(spatial):
        return NotImplemented  # F.interpolate's own error
    # (a symbolic size stays symbolic: `float()` of it would fix it; the comparison is a guard)
    if all(math.floor(n * s) == n for n, s in zip(spatial, scales, strict=True)):
        return input.clone()
    return NotImplemented


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {F.interpolate: _interpolate}
