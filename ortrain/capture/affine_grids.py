"""``affine_grid`` at an open batch or image size: the operator, with a backward that traces.

A spatial transformer network computes ``F.affine_grid(theta, x.size())``. Autograd's formula for
``affine_grid_generator`` is ``affine_grid_generator_backward``, whose kernel takes the size as
concrete integers: AOTAutograd's trace of the backward failed at the first new batch size
("SymIntArrayRef expected to contain only concrete integers", wave 42's STN), and the model fell
back to PyTorch for good. While capturing with a symbolic size, the function is replaced (above
autograd) by the same operator under a backward written with traceable ops: what the kernel
computes, the base grid's transpose times the grid's gradient (one ``bmm``). The forward stays
the operator, which PyTorch runs (``runtime/torch_native_ops.py``): at an identity transform the
sampler's gradient depends on the grid's last bit, and a decomposed grid (PyTorch's own, products
and a sum in ONNX Runtime) moved gradients by 2.7× their size. Fixed sizes keep the operator and
its formula. The operator takes the size as fixed integers in its forward too, so each new image
size still captures again (the batch size stays open).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import decompositions
from torch.nn import functional as F


class _AffineGrid(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, theta: torch.Tensor, size: list[Any], align_corners: bool) -> torch.Tensor:
        ctx.spatial, ctx.align_corners = size[2:], align_corners
        return torch.affine_grid_generator(theta, size, align_corners)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        make = (
            decompositions._make_base_grid_4d if len(ctx.spatial) == 2 else decompositions._make_base_grid_5d
        )
        base = make(grad, *ctx.spatial, align_corners=ctx.align_corners)  # [*spatial, k + 1]
        batch, k = grad.shape[0], grad.shape[-1]
        points = base.reshape(1, -1, k + 1).expand(batch, -1, -1)
        return points.transpose(1, 2).bmm(grad.reshape(batch, -1, k)).transpose(1, 2), None, None


def _affine_grid(theta: torch.Tensor, size: Sequence[Any], align_corners: bool | None = None) -> Any:
    """``F.affine_grid`` is replaced, not the operator it calls: a function mode does not see the
    calls its own handler makes."""
    spatial = {4: (2, 3), 5: (3, 4)}.get(len(size))
    symbolic = any(isinstance(s, torch.SymInt) for s in size)
    if not symbolic or spatial is None or not theta.is_floating_point() or theta.shape[1:] != spatial:
        return NotImplemented  # the function itself: fixed sizes, and its errors for bad input
    if align_corners is None:
        warnings.warn(  # PyTorch's own warning, which the function gives
            "Default grid_sample and affine_grid behavior has changed to align_corners=False since "
            "1.3.0. Please specify align_corners=True if the old behavior is desired. See the "
            "documentation of grid_sample for details.",
            stacklevel=3,
        )
        align_corners = False
    torch._check(all(s > 0 for s in size), lambda: f"Expected non-zero, positive output size. Got {size}")
    return _AffineGrid.apply(theta, list(size), align_corners)


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {F.affine_grid: _affine_grid}
