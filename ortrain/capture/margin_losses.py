"""The multi-class margin losses computed as PyTorch's kernels do, for captures.

``multilabel_margin_loss``: each row of its target lists the row's classes and ends at the first
-1. PyTorch's own decomposition (``torch._decomp``, torch 2.13), which AOTAutograd runs in place
of the operator (it is registered for the Autograd key, above any decomposition table), pairs every
target slot with every non-target class, the slots after the -1 as well, reading class 0 for
them: with any -1 in the target the loss and its gradient came out wrong, in ``torch.compile`` as
in ortrain (wave 34: 2.6 against eager's 0.8 on a 2 × 5 batch).

Both losses sum hinges ``max(0, margin - x[target] + x[j])``. PyTorch's kernels count a hinge in
the gradient only where it is positive (``z > 0``); the decompositions write it as
``clamp_min(z, 0)``, whose gradient passes at ``z == 0`` too, so a score exactly ``margin`` below
the target's (scores that are whole numbers, a ReLU's zeros against a target of 1) took a
gradient eager gives none (wave 37: ``multi_margin_loss`` a third larger on the target's score).
While capturing, both functions are replaced (above autograd) by these formulations, whose hinges
are ``where(z > 0, z, 0)``; autograd differentiates them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import _reduction
from torch.nn import functional as F

from ortrain.capture.autocast_float32 import autocast_to_float32

_NONE, _MEAN, _SUM = 0, 1, 2


def _hinge(z: torch.Tensor) -> torch.Tensor:
    """``max(z, 0)`` with PyTorch's kernels' gradient: none where ``z == 0``."""
    return torch.where(z > 0, z, torch.zeros_like(z))


def _reduction_enum(size_average: bool | None, reduce: bool | None, reduction: str) -> int:
    if size_average is not None or reduce is not None:
        return _reduction.legacy_get_enum(size_average, reduce)
    return _reduction.get_enum(reduction)


def _reduced(per_row: torch.Tensor, reduction: int, *, one_row: bool) -> torch.Tensor:
    """The rows' losses reduced as ``reduction`` asks; ``one_row``: an unbatched input's, 0-d."""
    if reduction == _MEAN:
        return per_row.mean()
    if reduction == _SUM:
        return per_row.sum()
    return per_row[0] if one_row else per_row


def _multilabel_loss(input: torch.Tensor, target: torch.Tensor, reduction: int) -> torch.Tensor:
    input = autocast_to_float32(input)  # both losses are on autocast's float32 list
    unbatched = input.dim() <= 1
    x, t = torch.atleast_2d(input), torch.atleast_2d(target)
    classes = x.shape[-1]
    index = torch.arange(classes, device=x.device)
    end = torch.where(t == -1, index, classes).amin(dim=-1, keepdim=True)
    slot = index < end  # [rows, slots]: the slots before the row's first -1
    picked = torch.gather(x, 1, torch.where(slot, t, 0))  # the target classes' scores
    listed = torch.where(slot, t, -1).unsqueeze(-1) == index  # [rows, slots, classes]
    is_target = listed.any(dim=1)  # [rows, classes]
    margins = _hinge(1.0 - picked.unsqueeze(-1) + x.unsqueeze(1))
    counted = slot.unsqueeze(-1) & ~is_target.unsqueeze(1)
    per_row = torch.where(counted, margins, torch.zeros_like(margins)).sum(dim=(1, 2)) / classes
    return _reduced(per_row, reduction, one_row=unbatched)


def multilabel_margin_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Any:
    return _multilabel_loss(input, target, _reduction_enum(size_average, reduce, reduction))


def _aten_multilabel_margin_loss(input: torch.Tensor, target: torch.Tensor, reduction: int = _MEAN) -> Any:
    return _multilabel_loss(input, target, reduction)


def _multi_margin_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    p: float,
    margin: float,
    weight: torch.Tensor | None,
    reduction: int,
) -> Any:
    if p not in (1, 2) or input.dim() > 2 or input.shape[-1] == 0:
        return NotImplemented  # PyTorch's own checks and messages
    input, weight = autocast_to_float32(input), autocast_to_float32(weight)
    unbatched = input.dim() <= 1
    x, t = torch.atleast_2d(input), target.reshape(-1, 1)
    classes = x.shape[-1]
    hinges = _hinge(margin - torch.gather(x, 1, t) + x)
    if p == 2:
        hinges = hinges * hinges
    if weight is not None:
        hinges = hinges * weight[t]
    others = torch.arange(classes, device=x.device) != t
    per_row = torch.where(others, hinges, torch.zeros_like(hinges)).sum(dim=1) / classes
    return _reduced(per_row, reduction, one_row=unbatched and target.dim() == 0)


def multi_margin_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    p: float = 1,
    margin: float = 1.0,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Any:
    enum = _reduction_enum(size_average, reduce, reduction)
    return _multi_margin_loss(input, target, p, margin, weight, enum)


OVERRIDES = {
    F.multilabel_margin_loss: multilabel_margin_loss,
    F.multi_margin_loss: multi_margin_loss,
    # TorchDynamo's graphs call the bindings under F's wrappers, with the reduction as a number.
    torch._C._nn.multilabel_margin_loss: _aten_multilabel_margin_loss,
    torch._C._nn.multi_margin_loss: _multi_margin_loss,
}
