"""Gathers and scatters without ONNX translation, as the scatters that have one.

``put`` (also ``take``'s backward) and ``index_reduce`` have no ONNX translation; both are a
``ScatterElements`` (``index_put`` / ``scatter_reduce``) over the right index.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def put(x: torch.Tensor, index: torch.Tensor, source: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """Writes (or adds) ``source`` at the flat positions ``index`` of ``x``; negative indices
    count from the end, as PyTorch."""
    flat = x.reshape(-1)
    positions = index.reshape(-1)
    positions = torch.where(positions < 0, positions + flat.shape[0], positions)
    return aten.index_put.default(flat, [positions], source.reshape(-1), accumulate).reshape(x.shape)


def index_reduce(
    x: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    source: torch.Tensor,
    reduce: str,
    *,
    include_self: bool = True,
) -> torch.Tensor:
    """``index_reduce`` is ``scatter_reduce`` with the 1-D index broadcast along ``dim``."""
    if x.dim() == 0:
        lifted = index_reduce(
            x.reshape(1), 0, index.reshape(1), source.reshape(1), reduce, include_self=include_self
        )
        return lifted.reshape(())
    dim = dim % x.dim()
    shape = [1] * source.dim()
    shape[dim] = -1
    expanded = index.reshape(shape).expand(source.shape)
    return aten.scatter_reduce.two(x, dim, expanded, source, reduce, include_self=include_self)


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The flat positions ``index`` of ``x`` (torch.export's own decomposition guards on data)."""
    flat = x.reshape(-1)
    positions = index.reshape(-1)
    positions = torch.where(positions < 0, positions + flat.shape[0], positions)
    return flat.index_select(0, positions).reshape(index.shape)


def scatter_reduce_mean(
    x: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    src: torch.Tensor,
    reduce: str,
    *,
    include_self: bool = True,
) -> torch.Tensor:
    """``scatter_reduce(reduce="mean")`` as a sum over a count. onnxscript translates "mean" as a
    plain scatter (ONNX's ScatterElements has no mean): the last value written wins, a wrong value
    without an error wherever an index repeats or ``include_self`` holds."""
    if reduce != "mean" or x.dim() == 0:
        return NotImplemented
    total = aten.scatter_reduce.two(x, dim, index, src, "sum", include_self=include_self)
    base = torch.ones_like(x) if include_self else torch.zeros_like(x)
    count = aten.scatter_add.default(base, dim, index, torch.ones_like(src))
    safe = torch.clamp(count, min=1)
    mean = total / safe if x.is_floating_point() else torch.div(total, safe, rounding_mode="floor")
    return torch.where(count == 0, x, mean)  # untouched positions keep x (only without include_self)


def masked_scatter_backward(grad: torch.Tensor, mask: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The gradient of ``masked_scatter``'s source: the gradient at the masked positions, in
    order, then zeros (PyTorch: ``masked_select`` padded, a data-dependent size). Here each
    masked position scatters to its rank among the masked ones; the others to a spare slot."""
    total = 1
    for size in sizes:
        total *= size
    flat_mask = mask.expand(grad.shape).reshape(-1)
    rank = torch.cumsum(flat_mask.to(torch.int64), 0) - 1
    index = torch.where(flat_mask, rank, torch.full_like(rank, total))
    spare = grad.new_zeros([total + 1])
    return spare.scatter_add(0, index, grad.reshape(-1))[:total].reshape(sizes)
