"""``embedding_bag`` forward and backward written with gathers and scatter-adds.

onnxscript translates ``_embedding_bag`` but returns zeros for its auxiliary outputs
(``offset2bag``, ``bag_size``, ``max_indices``), which PyTorch's backward reads: gradients would
come out wrong without an error. The backward ops have no translation at all. So the forward is
decomposed too, and computes the auxiliary outputs for real.
"""

from __future__ import annotations

import torch

SUM, MEAN, MAX = 0, 1, 2


def _offset2bag(indices: torch.Tensor, offsets: torch.Tensor, bags: int) -> torch.Tensor:
    """The bag of each index: how many bag starts lie at or before its position, minus one.

    Counted as a running sum of the starts per position (an empty bag's start repeats the next
    one's), linear in the indices: a comparison of every position with every start made an
    [indices x bags] mask, 4 GiB and 12 s a step at a thousand bags of ten (wave 49's review)."""
    count = indices.shape[0]
    starts = offsets[:bags].clamp(max=count)  # an empty last bag starts at the end
    per_position = torch.zeros(count + 1, dtype=torch.int64, device=indices.device).index_add(
        0, starts, torch.ones_like(starts, dtype=torch.int64)
    )
    return per_position.cumsum(0)[:count] - 1


def _refused_offsets_out_of_range(
    indices: torch.Tensor, offsets: torch.Tensor, decreasing_refused: bool
) -> torch.Tensor:
    """``indices``, each made out of range where PyTorch refuses the offsets: a first offset other
    than 0, a last one past the indices, and decreasing ones where its kernel refuses them (sum and
    mean of float32 and half tables without ``padding_idx``; the others accept them). The bag of each
    index is computed without such checks, and the bags came out of any offsets (wave 51's
    review: ``[0, 4, 2]`` pooled as ``[0, 2, 4]``, where eager raises); now the row gather raises,
    and ORTModule runs the step eagerly for PyTorch's own message (as for a negative index:
    :mod:`ortrain.export.negative_indices`)."""
    refused = (offsets[:1] != 0).any() | (offsets[-1:] > indices.shape[0]).any()
    if decreasing_refused:
        refused = refused | (offsets[1:] < offsets[:-1]).any()
    return torch.where(refused, torch.full_like(indices, torch.iinfo(indices.dtype).min), indices)


def _zero_unless(keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.zeros_like(x))


def _valid(indices: torch.Tensor, padding_idx: int) -> torch.Tensor:
    if padding_idx is None or padding_idx < 0:
        return torch.ones_like(indices, dtype=torch.bool)
    return indices != padding_idx


def embedding_bag(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    scale_grad_by_freq: bool = False,
    mode: int = SUM,
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if indices.dim() != 1:
        return NotImplemented
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    dim = weight.shape[1]
    offset2bag = _offset2bag(indices, offsets, bags)
    valid = _valid(indices, padding_idx)
    bag_size = torch.zeros(bags, dtype=torch.int64, device=weight.device).index_add(
        0, offset2bag, valid.to(torch.int64)
    )
    fast_kernel = mode != MAX and weight.dtype != torch.float64 and (padding_idx is None or padding_idx < 0)
    rows = weight.index_select(0, _refused_offsets_out_of_range(indices, offsets, fast_kernel))
    if mode == MAX:
        # Per bag and feature, the largest row value, then the first index that holds it (PyTorch's
        # choice among ties), each one scatter over the indices. PyTorch's kernel keeps a running
        # maximum that a later row replaces only when strictly larger: a NaN is the bag's maximum
        # where it is the bag's first counted row, and skipped anywhere else (the regression
        # review; ONNX's max reduction skips NaN or not by order).
        count = indices.shape[0]
        spread = offset2bag.unsqueeze(1).expand_as(rows)
        counted = valid.unsqueeze(1)
        position = torch.arange(count, device=weight.device)
        first_counted = torch.full((bags,), count, dtype=torch.int64, device=weight.device).scatter_reduce(
            0, offset2bag, torch.where(valid, position, torch.full_like(position, count)), "amin"
        )
        leading = (position == first_counted.index_select(0, offset2bag)).unsqueeze(1)
        is_nan = rows.isnan()
        nan = is_nan & counted & leading
        floor = torch.full_like(rows, -torch.inf)
        values = torch.full((bags, dim), -torch.inf, dtype=rows.dtype, device=rows.device).scatter_reduce(
            0, spread, torch.where(counted & ~is_nan, rows, floor), "amax"
        )
        any_nan = torch.zeros((bags, dim), dtype=torch.int64, device=rows.device).scatter_reduce(
            0, spread, nan.to(torch.int64), "amax"
        )
        values = torch.where(any_nan > 0, torch.full_like(values, torch.nan), values)
        row_position = position.unsqueeze(1).expand_as(rows)
        bag_nan = any_nan.index_select(0, offset2bag) > 0
        equal = (rows == values.index_select(0, offset2bag)) & counted
        holds = (bag_nan & nan) | (~bag_nan & equal)  # (ONNX Runtime has no Where of bools)
        beyond = torch.full_like(row_position, count)
        first = torch.full((bags, dim), count, dtype=torch.int64, device=weight.device).scatter_reduce(
            0, spread, torch.where(holds, row_position, beyond), "amin"
        )
        filled = (bag_size > 0).unsqueeze(1)
        output = _zero_unless(filled, values)
        # Position ``len(indices)`` (no index holds it: an empty bag) reads -1, PyTorch's mark.
        held = (
            torch.cat([indices, indices.new_full((1,), -1)]).index_select(0, first.flatten()).view_as(first)
        )
        max_indices = torch.where(filled, held, torch.full_like(first, -1))
        return output, offset2bag, bag_size, max_indices
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1)
    rows = _zero_unless(valid.unsqueeze(1), rows)
    output = torch.zeros(bags, dim, dtype=weight.dtype, device=weight.device).index_add(0, offset2bag, rows)
    if mode == MEAN:
        output = output / bag_size.clamp(min=1).to(weight.dtype).unsqueeze(1)
    max_indices = torch.zeros(bags, dtype=torch.int64, device=weight.device)
    return output, offset2bag, bag_size, max_indices


def embedding_bag_dense_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    offset2bag: torch.Tensor,
    bag_size: torch.Tensor,
    maximum_indices: torch.Tensor,
    num_weights: int,
    scale_grad_by_freq: bool,
    mode: int,
    per_sample_weights: torch.Tensor | None,
    padding_idx: int = -1,
) -> torch.Tensor:
    if scale_grad_by_freq:
        # PyTorch's CPU kernel does not divide by each index's frequency in the batch as
        # documented (measured: an index seen once in a bag of three gets a third of its
        # gradient); rather than a gradient that differs from eager, refuse at capture.
        raise NotImplementedError(
            "ortrain does not train embedding_bag(scale_grad_by_freq=True): its PyTorch gradient "
            "cannot be reproduced; use scale_grad_by_freq=False or let PyTorch run the model"
        )
    dim = grad.shape[1]
    result = torch.zeros(num_weights, dim, dtype=grad.dtype, device=grad.device)
    if mode == MAX:
        filled = (bag_size > 0).unsqueeze(1)
        return result.scatter_add(0, _zero_unless(filled, maximum_indices), _zero_unless(filled, grad))
    contrib = grad.index_select(0, offset2bag)
    if per_sample_weights is not None:
        contrib = contrib * per_sample_weights.unsqueeze(1)
    if mode == MEAN:
        contrib = contrib / bag_size.index_select(0, offset2bag).clamp(min=1).to(grad.dtype).unsqueeze(1)
    contrib = _zero_unless(_valid(indices, padding_idx).unsqueeze(1), contrib)
    return result.index_add(0, indices, contrib)


def embedding_bag_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    offset2bag: torch.Tensor,
    bag_size: torch.Tensor,
    maximum_indices: torch.Tensor,
    num_weights: int,
    scale_grad_by_freq: bool,
    mode: int,
    sparse: bool,
    per_sample_weights: torch.Tensor | None,
    padding_idx: int = -1,
) -> torch.Tensor:
    if sparse:
        return NotImplemented
    return embedding_bag_dense_backward(
        grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
        per_sample_weights, padding_idx,
    )  # fmt: skip


def embedding_bag_per_sample_weights_backward(
    grad: torch.Tensor,
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    offset2bag: torch.Tensor,
    mode: int,
    padding_idx: int = -1,
) -> torch.Tensor:
    rows = weight.index_select(0, indices)
    result = (grad.index_select(0, offset2bag) * rows).sum(1)
    return _zero_unless(_valid(indices, padding_idx), result)
