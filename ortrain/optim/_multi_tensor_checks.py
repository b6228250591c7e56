"""Overflow checks and gradient norms over many tensors with a constant number of kernel launches.

Per-tensor versions (``for g in grads: bad |= isinf(g).any()``) launch a few kernels per tensor and, in
older DeepSpeed/Apex releases, synchronise with the host once per tensor. Here the per-tensor reductions are
one ``torch._foreach_norm`` per (device, dtype) bucket, and the result stays on the device: callers pay at
most one host synchronisation, when they read the flag.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["bucket_by_device_and_dtype", "multi_tensor_norm", "nonfinite_flag"]


def bucket_by_device_and_dtype(
    tensors: Iterable[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    return buckets


def nonfinite_flag(tensors: Iterable[Tensor | None], device: torch.device | str | None = None) -> Tensor:
    """0-dim bool tensor: whether any element of any tensor is inf or NaN.

    The inf-norm (max |x|) of a tensor is non-finite exactly when the tensor holds an inf or a NaN (NaN
    propagates through max), and unlike a sum of squares it cannot overflow on finite inputs.
    """
    present = [t for t in tensors if t is not None and t.numel() > 0]
    buckets = bucket_by_device_and_dtype(t._values() if t.is_sparse else t for t in present)
    if device is None:
        device = present[0].device if present else torch.device("cpu")
    flags: list[Tensor] = []
    for (bucket_device, _), ts in buckets.items():
        norms = torch._foreach_norm(ts, float("inf"))
        flag = torch.stack(norms).isfinite().all().logical_not()
        flags.append(flag if bucket_device == torch.device(device) else flag.to(device))
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any() if len(flags) > 1 else flags[0]


def multi_tensor_norm(
    tensors: Iterable[Tensor],
    norm_type: float = 2.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """0-dim tensor (``dtype``): the ``norm_type``-norm of all tensors viewed as one vector."""
    present = [t for t in tensors if t.numel() > 0]
    if device is None:
        device = present[0].device if present else torch.device("cpu")
    per_tensor: list[Tensor] = []
    for (bucket_device, _), ts in bucket_by_device_and_dtype(present).items():
        norms = torch.stack(torch._foreach_norm(ts, norm_type, dtype=dtype))
        per_tensor.append(norms if bucket_device == torch.device(device) else norms.to(device))
    if not per_tensor:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.linalg.vector_norm(torch.cat(per_tensor), norm_type)
