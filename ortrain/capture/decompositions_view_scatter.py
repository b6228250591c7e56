"""View-scatters (write ``src`` into the elements of ``base`` a view selects) as one index scatter.

The backward of a view that picks scattered elements (``x.diagonal()``, ``x.as_strided(...)``,
``torch.diag``) is a view-scatter into zeros: ``diagonal_backward``, ``diagonal_scatter``,
``as_strided_scatter``. onnxscript has no translation for them, and PyTorch's own decompositions
write through a view (``out.diagonal().copy_(src)``): the export of such a graph stops on
``prims.copy_to`` ("aot_autograd expected to have an entirely functional graph").

Every view-scatter here is written one functional way: apply the same view to the positions
``arange(base.numel())`` laid out like ``base``, then scatter ``src`` flat into ``base`` flat at
those positions. The view of positions uses ops that have translations (``diagonal``,
``as_strided``), and with static shapes the positions fold into a constant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten


def _scatter_into_view(
    base: torch.Tensor, src: torch.Tensor, view: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    positions = view(torch.arange(base.numel(), device=base.device).view(base.shape))
    flat = base.reshape(-1).scatter(0, positions.reshape(-1), src.reshape(-1).to(base.dtype))
    return flat.view(base.shape)


def diagonal_scatter(
    base: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> torch.Tensor:
    return _scatter_into_view(base, src, lambda p: p.diagonal(offset, dim1, dim2))


def diagonal_backward(
    grad_output: torch.Tensor, input_sizes: Sequence[int], offset: int, dim1: int, dim2: int
) -> torch.Tensor:
    return diagonal_scatter(grad_output.new_zeros(input_sizes), grad_output, offset, dim1, dim2)


def as_strided_scatter(
    base: torch.Tensor,
    src: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: int | None = None,
) -> Any:
    # ``size``/``stride``/``storage_offset`` address base's storage; the positions tensor's storage
    # is base's logical order only when base is contiguous from the start of its storage. Any
    # other base stays an as_strided_scatter, for the per-operator fallback to run in PyTorch.
    if not base.is_contiguous() or base.storage_offset() != 0:
        return NotImplemented
    offset = 0 if storage_offset is None else storage_offset
    return _scatter_into_view(base, src, lambda p: p.as_strided(size, stride, offset))


def view_scatter_table() -> dict[Any, Callable[..., Any]]:
    return {
        aten.diagonal_backward.default: diagonal_backward,
        aten.diagonal_scatter.default: diagonal_scatter,
        aten.as_strided_scatter.default: as_strided_scatter,
    }
