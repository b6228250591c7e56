"""``torch.as_strided`` and ``as_strided_scatter`` address memory, which ONNX Runtime lays out otherwise.

They index a tensor's *storage* with the strides given, not its values in logical order: on a
transposed view, ``torch.as_strided(h, (4, 2), (1, 4))`` reads the elements of the tensor the view
was taken of. ONNX Runtime's tensors are contiguous, and its translation of ``as_strided`` indexes
the values in logical order: a captured graph computed other numbers than eager wherever the input
was not contiguous (wave 19: the loss 2.28 where eager's was 6.01, in ONNX Runtime's placement only).

While capturing, a call on a tensor whose elements are laid out without gaps in some order of
dimensions (a transposed or permuted result, a slice that starts at an offset) is rewritten to
index those elements in memory order explicitly: ``h.permute(order).reshape(-1)[positions]``, the
positions counted from the tensor's first element, the same numbers in every executor. A call
that reaches memory outside the tensor's own elements (past the end of a slice, into the rest of
the tensor it was taken from), or on a tensor with gaps, has memory the graph cannot reproduce:
the capture refuses it by name (the fallback policy then trains the model in PyTorch), where
``.contiguous()`` before the call is the way around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ortrain.capture.memory_layouts import dense_dim_order, inverse_order, size_hint


class StorageViewError(RuntimeError):
    """``as_strided`` on a tensor whose storage the captured graph cannot reproduce."""


def _addressing(
    tensor: torch.Tensor, size: Sequence[Any], stride: Sequence[Any], storage_offset: Any, name: str
) -> tuple[tuple[int, ...] | None, Any]:
    """How to address ``tensor``'s memory from its values: the order of its dimensions in memory
    (None: logical order) and the offset from its first element. Raises where the call reaches
    memory outside the tensor's own elements, which a captured graph does not have."""
    order = dense_dim_order(tensor)
    start = tensor.storage_offset()
    offset = start if storage_offset is None else storage_offset
    first = size_hint(offset - start)
    hints = [(size_hint(n), size_hint(k)) for n, k in zip(size, stride, strict=True)]
    known = first is not None and all(n is not None and k is not None for n, k in hints)
    last = first + sum((n - 1) * k for n, k in hints if n) if known else None  # type: ignore[operator]
    if order is None or last is None or first < 0 or last >= tensor.numel():  # type: ignore[operator]
        raise StorageViewError(
            f"{name} reaches memory outside the tensor it is given (sizes {tuple(tensor.shape)}, "
            f"strides {tensor.stride()}, offset {start}; asked for sizes {tuple(size)}, strides "
            f"{tuple(stride)}, offset {offset}): a captured graph has only the tensor's own values; "
            f"call .contiguous() on the tensor before {name}, or address within it"
        )
    return (None if order == tuple(range(tensor.dim())) else order), offset - start


def _in_storage_order(tensor: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    return tensor.reshape(-1) if order is None else tensor.permute(*order).reshape(-1)


def _positions(size: Sequence[Any], stride: Sequence[Any], offset: Any) -> torch.Tensor:
    """The memory position (from the tensor's first element) of each element ``as_strided`` reads.

    An index, not a second ``as_strided``: PyTorch would read a view at its own storage offset
    (a slice's rows start past zero), ONNX Runtime's translation at the value's first element."""
    positions = torch.full(list(size), offset, dtype=torch.int64)
    for d, (n, k) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[d] = n
        positions = positions + (torch.arange(n, dtype=torch.int64) * k).view(shape)
    return positions


def _unknown_reach_in_logical_order(
    tensor: torch.Tensor, size: Sequence[Any], stride: Sequence[Any], storage_offset: Any
) -> bool:
    """A contiguous tensor at the start of its storage, addressed with sizes that depend on values
    (Longformer's chunk count, a 0-d tensor): where its reach cannot be checked, its memory is its
    values in logical order, which every executor's ``as_strided`` reads alike."""
    if not tensor.is_contiguous() or tensor.storage_offset() != 0:
        return False
    numbers = [*size, *stride, 0 if storage_offset is None else storage_offset]
    return any(size_hint(n) is None for n in numbers)


def as_strided(
    input: torch.Tensor, size: Sequence[Any], stride: Sequence[Any], storage_offset: Any = None
) -> Any:
    if _unknown_reach_in_logical_order(input, size, stride, storage_offset):
        return NotImplemented
    order, offset = _addressing(input, size, stride, storage_offset, "torch.as_strided")
    if order is None and input.storage_offset() == 0:
        return NotImplemented  # the tensor is its memory, in logical order: the same everywhere
    return _in_storage_order(input, order)[_positions(size, stride, offset)]


def as_strided_scatter(
    input: torch.Tensor,
    src: torch.Tensor,
    size: Sequence[Any],
    stride: Sequence[Any],
    storage_offset: Any = None,
) -> Any:
    order, offset = _addressing(input, size, stride, storage_offset, "torch.as_strided_scatter")
    if order is None and input.storage_offset() == 0:
        return NotImplemented
    positions = _positions(size, stride, offset).reshape(-1)
    flat = _in_storage_order(input, order).index_put((positions,), src.reshape(-1))
    if order is None:
        return flat.view(input.shape)
    permuted_shape = [input.shape[d] for d in order]
    return flat.view(permuted_shape).permute(*inverse_order(order))


OVERRIDES = {
    torch.as_strided: as_strided,
    torch.Tensor.as_strided: as_strided,
    torch.as_strided_scatter: as_strided_scatter,
    torch.Tensor.as_strided_scatter: as_strided_scatter,
}
