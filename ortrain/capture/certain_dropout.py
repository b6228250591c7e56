"""Dropout with ``p = 1`` zeros its input without drawing a mask, as eager's CPU kernel does.

Traced, ``F.dropout`` goes through PyTorch's Python decomposition, which calls ``native_dropout``
for every ``p`` but 0: at ``p = 1`` that draws a mask eager never draws (its kernel returns
``input * 0`` first), so every random number after it (the next dropout, ``randn_like``, the
training loop's own draws) came from another state than eager's (wave 47's review: the loss 0.087
for eager's 0.768, a schedule reaching ``p = 1`` shifting every later step). Written here as
eager's kernel computes it (``input * 0``: NaN and infinities stay NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    if not (training and isinstance(p, int | float) and p == 1):
        return NotImplemented
    zero = torch.zeros((), dtype=input.dtype, device=input.device)
    return input.mul_(zero) if inplace else input * zero


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {F.dropout: _dropout}
