"""``multilabel_margin_loss`` computed as PyTorch's kernel does, for captures.

Each row of its target lists the row's classes and ends at the first -1. PyTorch's own
decomposition (``torch._decomp``, torch 2.13), which AOTAutograd runs in place of the operator
(it is registered for the Autograd key, above any decomposition table), pairs every target slot
with every non-target class, the slots after the -1 as well, reading class 0 for them: with any
-1 in the target the loss and its gradient came out wrong, in ``torch.compile`` as in ortrain
(wave 34: 2.6 against eager's 0.8 on a 2 × 5 batch). While capturing, the function is replaced
(above autograd) by this formulation, which masks those slots; autograd differentiates it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import _reduction
from torch.nn import functional as F

_NONE, _MEAN, _SUM = 0, 1, 2


def _loss(input: torch.Tensor, target: torch.Tensor, reduction: int) -> torch.Tensor:
    unbatched = input.dim() <= 1
    x, t = torch.atleast_2d(input), torch.atleast_2d(target)
    classes = x.shape[-1]
    index = torch.arange(classes, device=x.device)
    end = torch.where(t == -1, index, classes).amin(dim=-1, keepdim=True)
    slot = index < end  # [rows, slots]: the slots before the row's first -1
    picked = torch.gather(x, 1, torch.where(slot, t, 0))  # the target classes' scores
    listed = torch.where(slot, t, -1).unsqueeze(-1) == index  # [rows, slots, classes]
    is_target = listed.any(dim=1)  # [rows, classes]
    margins = (1.0 - picked.unsqueeze(-1) + x.unsqueeze(1)).clamp_min(0)
    counted = slot.unsqueeze(-1) & ~is_target.unsqueeze(1)
    per_row = torch.where(counted, margins, torch.zeros_like(margins)).sum(dim=(1, 2)) / classes
    if reduction == _MEAN:
        return per_row.mean()
    if reduction == _SUM:
        return per_row.sum()
    return per_row[0] if unbatched else per_row


def multilabel_margin_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Any:
    if size_average is not None or reduce is not None:
        enum = _reduction.legacy_get_enum(size_average, reduce)
    else:
        enum = _reduction.get_enum(reduction)
    return _loss(input, target, enum)


def _aten_multilabel_margin_loss(input: torch.Tensor, target: torch.Tensor, reduction: int = _MEAN) -> Any:
    return _loss(input, target, reduction)


OVERRIDES = {
    F.multilabel_margin_loss: multilabel_margin_loss,
    # TorchDynamo's graphs call the binding under F's wrapper, with the reduction as a number.
    torch._C._nn.multilabel_margin_loss: _aten_multilabel_margin_loss,
}
