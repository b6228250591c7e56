"""``h[mask] = v`` with a value that is the same for every selected row, captured without a count.

Eager PyTorch runs a boolean-mask assignment with a tensor value as ``index_put_``, whose backward
reads ``grad[mask]``: an operator whose output size is the number of ``True`` entries, a value the
captured graph cannot have. The whole-graph capture failed on it in the backward, TorchDynamo's
graphs too (its "Backend compiler exception", twice, and the whole forward ran in eager PyTorch,
ortrain saying so only at INFO): Wav2Vec2's and HuBERT's SpecAugment
(``hidden_states[mask_time_indices] = self.masked_spec_embed``), a masked-LM's mask token.

When the value does not depend on how many rows the mask selects (it broadcasts to one row: a
vector of the row's size, a ``(1, d)`` row), the assignment is ``where(mask, v, h)`` written back
into ``h``: the same values, and autograd's gradients of ``where`` are ``index_put_``'s (zero into
the assigned positions of ``h``, the selected rows' gradients summed into ``v``). Values with one
row per selected position, other dtypes (which eager refuses) and every other index go to
PyTorch's ``__setitem__`` unchanged. Numbers and 0-d values that need no gradient are assigned
with ``masked_fill_``, which traces: also unchanged. A 0-d value that does (``h[m] = self.a``, a
learned scalar) is the ``where`` above: its gradient went through a ``nonzero`` until wave 45, and
the model ran in PyTorch, refused under ``FALLBACK_DISABLE``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_SETITEM = torch.Tensor.__setitem__


def _mask_position(index: Any) -> tuple[int, torch.Tensor] | None:
    """Where the one boolean mask of ``index`` starts among the target's dimensions, and the mask:
    ``h[mask]`` or ``h[:, :, mask]`` (full slices before it). None for any other index."""
    parts = index if isinstance(index, tuple) else (index,)
    if not parts:
        return None
    *leading, mask = parts
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() == 0:
        return None
    if not all(isinstance(p, slice) and p == slice(None) for p in leading):
        return None
    return len(leading), mask


def _one_row_value(value: torch.Tensor, leading: int, tail: int) -> torch.Tensor | None:
    """``value`` as a tensor that broadcasts to ``target[mask]``'s shape, ``leading`` dimensions,
    the selected rows, ``tail`` dimensions, without the rows' count: that dimension 1 or absent,
    read from the right as eager broadcasts (leading 1s dropped). None where the value has a
    dimension for the selected rows (one row each)."""
    if value.dim() <= tail:
        return value
    while value.dim() > leading + 1 + tail and value.shape[0] == 1:
        value = value.squeeze(0)
    if value.dim() > leading + 1 + tail or value.shape[value.dim() - tail - 1] != 1:
        return None
    return value


def assign_through_mask(target: torch.Tensor, index: Any, value: Any) -> Any:
    found = _mask_position(index)
    if found is None or not isinstance(value, torch.Tensor):
        return NotImplemented
    if value.dim() == 0 and not value.requires_grad:
        return NotImplemented  # ``masked_fill_``, which traces (see the module)
    start, mask = found
    mask_dims = mask.dim()
    if target.dim() < start + mask_dims or value.dtype != target.dtype or value.device != target.device:
        return NotImplemented
    if tuple(mask.shape) != tuple(target.shape[start : start + mask_dims]):
        return NotImplemented  # eager's error ("the shape of the mask ... does not match")
    tail = target.dim() - start - mask_dims
    row_value = _one_row_value(value, start, tail)
    if row_value is None:
        return NotImplemented
    # The value's row dimension (size 1) widened to the mask's dimensions, the mask given the
    # target's trailing ones: both broadcast against the target in place.
    if row_value.dim() > tail:
        row_dim = row_value.dim() - tail - 1
        shape = (*row_value.shape[:row_dim], *([1] * mask_dims), *row_value.shape[row_dim + 1 :])
        row_value = row_value.reshape(shape)
    wide_mask = mask.reshape(*([1] * start), *mask.shape, *([1] * tail))
    target.copy_(torch.where(wide_mask, row_value, target))
    return None


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {_SETITEM: assign_through_mask}
