"""Multi-tensor Adam step as one Triton kernel launch per (parameter dtype, gradient dtype) bucket.

Every tensor of the bucket is cut into ``BLOCK``-element chunks; a chunk table (tensor index, start offset)
gives each Triton program its chunk, and pointer tables give the addresses of that tensor's parameter,
gradient and moments. So one launch updates any number of tensors of any sizes, like apex's
``multi_tensor_apply``, without copying parameters into a flat buffer.

Math is fp32 whatever the parameter dtype (fp32, fp16, bf16): parameters and gradients are upcast on load
and the parameter rounded on store; the moments are fp32 tensors.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ortrain.optim.fused_adam import _Hyper

logger = logging.getLogger("ortrain.optim.multi_tensor_adam_triton")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # triton is an optional dependency (extra "triton")
    HAS_TRITON = False

# Elements per program: 8 per thread at 4 warps keeps the four fp32 streams in registers.
BLOCK = 1024
NUM_WARPS = 4
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)

if HAS_TRITON:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

    @triton.jit
    def _round_to_bf16(x):
        # Explicit round-to-nearest-even: Triton's interpreter (TRITON_INTERPRET=1, the CPU test path)
        # truncates fp32 -> bf16 while compiled kernels round to nearest, so spell out the GPU rounding to
        # make both, and torch's .to(torch.bfloat16), agree bit for bit.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        rne = (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rne)  # NaN stays NaN (rounding could carry it to inf)

    @triton.jit
    def _adam_kernel(
        tables,  # int64: [p_ptrs | g_ptrs | m_ptrs | v_ptrs | numels], each n_tensors long
        chunk_tensor,  # int64 [n_chunks]: tensor index of each chunk
        chunk_start,  # int64 [n_chunks]: first element of each chunk within its tensor
        n_tensors,
        step_size,
        beta1,
        beta2,
        eps,
        sqrt_bc2,
        weight_decay,
        decay,
        MODE: tl.constexpr,
        P_DTYPE: tl.constexpr,
        G_DTYPE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(chunk_tensor + pid)
        start = tl.load(chunk_start + pid)
        numel = tl.load(tables + 4 * n_tensors + t)
        p_ptr = tl.load(tables + t).to(tl.pointer_type(P_DTYPE))
        g_ptr = tl.load(tables + n_tensors + t).to(tl.pointer_type(G_DTYPE))
        m_ptr = tl.load(tables + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(tables + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))

        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

        if MODE == 0:  # L2 regularisation: decay folded into the gradient
            g = g + weight_decay * p
        if MODE == 2:  # torch AdamW: decoupled decay before the update
            p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        if MODE == 1:  # transformers AdamW: step_size = lr·√bc2/bc1, decay after the update
            p = p - step_size * m / (tl.sqrt(v) + eps)
            p = p * decay
        else:  # step_size = lr/bc1
            p = p - step_size * m / (tl.sqrt(v) / sqrt_bc2 + eps)

        if P_DTYPE == tl.bfloat16:
            p_out = _round_to_bf16(p)
        else:
            p_out = p.to(P_DTYPE)
        tl.store(p_ptr + offs, p_out, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def can_run(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor]
) -> bool:
    """Whether the kernel takes this bucket: Triton importable, supported dtypes, contiguous tensors."""
    if not HAS_TRITON:
        return False
    if params[0].dtype not in _SUPPORTED or grads[0].dtype not in _SUPPORTED:
        return False
    if exp_avgs[0].dtype != torch.float32:
        return False
    # The kernel addresses element i of every tensor at base + i, so all four must be contiguous.
    return all(
        p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    )


# Chunk tables depend only on the tensor sizes, which rarely change between steps.
_chunk_cache: dict[tuple[torch.device, tuple[int, ...]], tuple[Tensor, Tensor]] = {}


def _chunk_tables(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    key = (device, numels)
    cached = _chunk_cache.get(key)
    if cached is not None:
        return cached
    sizes = torch.tensor(numels, dtype=torch.int64)
    counts = (sizes + BLOCK - 1) // BLOCK
    chunk_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    chunk_start = (torch.arange(int(counts.sum()), dtype=torch.int64) - first_chunk[chunk_tensor]) * BLOCK
    if len(_chunk_cache) > 64:  # many distinct bucket shapes: keep memory bounded
        _chunk_cache.clear()
    _chunk_cache[key] = cached = (chunk_tensor.to(device), chunk_start.to(device))
    return cached


def multi_tensor_adam(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], h: _Hyper
) -> None:
    """One Adam step of ``FusedAdam`` over a bucket of same-dtype tensors, as a single kernel launch."""
    from ortrain.optim.fused_adam import AdamWMode  # deferred: fused_adam imports this module

    if any(p.numel() == 0 for p in params):  # empty tensors have no chunk; drop them from all lists
        keep = [i for i, p in enumerate(params) if p.numel() > 0]
        params, grads = [params[i] for i in keep], [grads[i] for i in keep]
        exp_avgs, exp_avg_sqs = [exp_avgs[i] for i in keep], [exp_avg_sqs[i] for i in keep]
    if not params:
        return
    device = params[0].device
    n = len(params)
    table_values = (
        [p.data_ptr() for p in params]
        + [g.data_ptr() for g in grads]
        + [m.data_ptr() for m in exp_avgs]
        + [v.data_ptr() for v in exp_avg_sqs]
        + [p.numel() for p in params]
    )
    tables = torch.tensor(table_values, dtype=torch.int64).to(device, non_blocking=True)
    chunk_tensor, chunk_start = _chunk_tables(tuple(p.numel() for p in params), device)

    bc1, bc2 = h.bias_corrections
    if h.mode == AdamWMode.ADAMW_TRANSFORMERS:
        step_size = h.lr * math.sqrt(bc2) / bc1
    else:
        step_size = h.lr / bc1
    decay = 1.0 - h.lr * h.weight_decay
    grid = (chunk_tensor.numel(),)
    _adam_kernel[grid](
        tables,
        chunk_tensor,
        chunk_start,
        n,
        step_size,
        h.beta1,
        h.beta2,
        h.eps,
        math.sqrt(bc2),
        h.weight_decay,
        decay,
        MODE=int(h.mode),
        P_DTYPE=_TL_DTYPES[params[0].dtype],
        G_DTYPE=_TL_DTYPES[grads[0].dtype],
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
