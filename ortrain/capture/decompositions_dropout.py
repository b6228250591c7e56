"""Dropout's gradient on CPU as eager computes it: times the noise rounded to the gradient's dtype.

Eager's CPU ``F.dropout`` is not ``native_dropout`` (that is CUDA's fused kernel): it draws
``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)`` in ``x``'s dtype and returns ``x * noise``,
so its gradient is ``grad * noise``, the scale rounded to the dtype first. Traced, ``F.dropout``
becomes ``native_dropout``, whose backward ``native_dropout_backward(grad, mask, scale)`` multiplies
by the unrounded scale (in float32 for bfloat16 and float16, rounding once): under bfloat16 autocast
every gradient through a dropout came out one bfloat16 unit off eager's (wave 54: ``f1.weight``'s
gradient 3.8e-3 relative off behind ``Dropout(0.1)``; at ``p = 0`` equal). The forward is eager's
already (``native_dropout``'s CPU kernel rounds the scale to the dtype too: checked over 203 rates),
and so is ``ortrain.capture.memory_optimizer``'s rebuild of it (``_kernel_scale``).

The gradient is written here as ``grad * (mask * noise)``: ``mask * noise`` is exactly 0 or the
noise (a number of the dtype), and the product with ``grad`` rounds once, in PyTorch as in ONNX
Runtime (IEEE products of the dtype's values). ``noise`` is eager's ``1 / (1 - p)`` as its kernel
divides (in float32 for the half types, then rounded; in the dtype otherwise), from ``1 - p``
recovered as ``1 / scale``: within one float64 unit of eager's, the same float32 number unless
``1 - p`` lies within that of a float32 rounding midpoint. Elsewhere than CPU (CUDA's eager is the
fused kernel, unrounded scale) and outside the four float dtypes the op stays as it is.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

aten = torch.ops.aten

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _to_float32(x: float) -> float:
    # struct's "f" rounds a float64 to the nearest float32, ties to even, as a C cast does.
    return struct.unpack("f", struct.pack("f", x))[0]


def _float32_to_bfloat16(x: float) -> float:
    # PyTorch's float -> bfloat16 conversion (c10 round_to_nearest_even): add half an ulp of the
    # kept 16 bits, plus one where the kept part is odd, and cut.
    bits = struct.unpack("I", struct.pack("f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("f", struct.pack("I", bits))[0]


def _float32_to_float16(x: float) -> float:
    # struct's "e" rounds to the nearest float16, ties to even; x is already a float32 value, so
    # this is the one rounding eager's float -> half conversion makes.
    return struct.unpack("e", struct.pack("e", x))[0]


def eager_noise(dtype: torch.dtype, scale: float) -> float | None:
    """The value eager's CPU dropout multiplies kept elements by in ``dtype`` (``1.0 / (1 - p)``
    as ``div_`` computes it), given ``native_dropout_backward``'s ``scale = 1 / (1 - p)``; None
    where there is no such finite number."""
    if dtype == torch.float64:
        return scale  # eager's div_ in float64 computes 1.0 / (1 - p): the scale itself
    try:
        kept = _to_float32(1.0 / scale)  # float32(1 - p), which eager's div_ divides by
        noise = _to_float32(1.0 / kept)  # float64's quotient of two float32s rounds as float32's
        if dtype == torch.bfloat16:
            noise = _float32_to_bfloat16(noise)
        elif dtype == torch.float16:
            noise = _float32_to_float16(noise)
    except (OverflowError, ZeroDivisionError):
        return None
    return noise if math.isfinite(noise) else None


def native_dropout_backward(grad_output: torch.Tensor, mask: torch.Tensor, scale: Any) -> Any:
    """``native_dropout_backward`` on CPU as eager's ``grad * noise`` (the module's text)."""
    if (
        not isinstance(scale, float)
        or not 0.0 < scale < math.inf
        or grad_output.device.type != "cpu"
        or grad_output.dtype not in _FLOAT_DTYPES
    ):
        return NotImplemented
    noise = eager_noise(grad_output.dtype, scale)
    if noise is None:
        return NotImplemented
    return grad_output * (mask.to(grad_output.dtype) * noise)
