"""2-D grid sampling replaced, while capturing, by PyTorch's own decomposition, above autograd.

``aten.grid_sampler_2d`` exports (the exporter decomposes it), but its backward,
``aten.grid_sampler_2d_backward``, has no ONNX translation. PyTorch's reference decomposition
(``torch._decomp``) writes the sampling with gathers, floors and weights; swapped in above
autograd (see :mod:`ortrain.capture.function_overrides`), autograd differentiates it into
scatter-adds and elementwise ops, which export (values and both gradients within 1e-13 of
PyTorch's kernels in float64, every padding mode and corner alignment). 3-D sampling is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._decomp.decompositions import _grid_sampler_2d

_MODES = {"bilinear": 0, "nearest": 1, "bicubic": 2}
_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


def grid_sampler_2d_function(
    input: torch.Tensor,
    grid: torch.Tensor,
    interpolation_mode: int = 0,
    padding_mode: int = 0,
    align_corners: bool = False,
) -> Any:
    """``torch.grid_sampler_2d`` / ``torch.grid_sampler`` on 4-D inputs, bilinear or bicubic.
    Nearest is left alone: the decomposition gives the grid no gradient where PyTorch gives it
    zeros (an optimizer with weight decay would then treat the grid differently)."""
    if input.dim() != 4 or interpolation_mode == _MODES["nearest"]:
        return NotImplemented
    return _grid_sampler_2d(
        input,
        grid=grid,
        interpolation_mode=interpolation_mode,
        padding_mode=padding_mode,
        align_corners=align_corners,
    )


def grid_sample_function(
    input: torch.Tensor,
    grid: torch.Tensor,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
    align_corners: bool | None = None,
) -> Any:
    """``F.grid_sample`` on 4-D inputs (its argument checks and warnings stay PyTorch's)."""
    if input.dim() != 4 or mode not in _MODES or padding_mode not in _PADDINGS:
        return NotImplemented
    return grid_sampler_2d_function(input, grid, _MODES[mode], _PADDINGS[padding_mode], bool(align_corners))
