"""Memory layouts of traced values: the dimension order a dense tensor is laid out in.

A captured graph records each value's strides as eager PyTorch made them (a transposed view, the
layout-preserving result of an elementwise op on one), while a value that crosses from ONNX
Runtime is contiguous. The few operators whose result depends on memory order, not only on values
(random draws "like" an input, ``as_strided``), need the recorded order back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def size_hint(value: object) -> int | None:
    """A size or stride as the capture saw it (a symbolic one by its example value)."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else None
    return None


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two traced values are views of one storage (fake tensors included)."""
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
        return False


def dense_dim_order(value: object) -> tuple[int, ...] | None:
    """The dimensions of ``value`` from outermost to innermost in memory when its elements fill one
    block without gaps or overlaps (any order of dimensions); None when they do not, or when the
    sizes are unknown."""
    if not isinstance(value, torch.Tensor):
        return None
    sizes = [size_hint(s) for s in value.shape]
    strides = [size_hint(s) for s in value.stride()]
    if None in sizes or None in strides:
        return None
    order = sorted(range(value.dim()), key=lambda d: -strides[d])  # type: ignore[operator]
    expected = 1
    for d in reversed(order):  # dense: each stride is the product of the sizes inside it
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]  # type: ignore[operator]
    return tuple(order)


def permuted_dim_order(value: object) -> tuple[int, ...] | None:
    """:func:`dense_dim_order` when that is not the plain (contiguous) order, else None."""
    order = dense_dim_order(value)
    if order is None or order == tuple(range(len(order))):
        return None
    return order


def inverse_order(order: tuple[int, ...] | list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, d in enumerate(order):
        inverse[d] = position
    return inverse


def densely_in_order(tensor: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``tensor`` with the same values, laid out densely in dimension ``order`` (outermost first):
    itself when it already is, else a tensor of its own (not a view of a permuted copy)."""
    if dense_dim_order(tensor) == tuple(order):
        return tensor
    strides = [0] * tensor.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= tensor.shape[d]
    laid_out = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device)
    return laid_out.copy_(tensor)
