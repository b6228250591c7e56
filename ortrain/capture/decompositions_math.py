"""Elementwise and distance ops written with ops that have ONNX translations.

The exporter lowers ``hypot``, ``erfinv`` and ``cumprod`` to ``prims`` ops that have no ONNX
translation, and ``_cdist_forward``/``_cdist_backward`` (also behind ``pdist``) have none at
all; ``nextafter``'s ``prims.nextafter`` neither, nor the FFT's sample frequencies (``fftfreq``,
``rfftfreq``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch._refs

aten = torch.ops.aten


def hypot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sqrt(a² + b²)`` without squaring the larger one (wave 35: ``a * a`` overflowed float32
    from 1.9e19 and underflowed below 1e-23, where PyTorch's ``std::hypot`` is exact): the larger
    magnitude times ``sqrt(1 + ratio²)``. As C's, an infinity wins over a NaN."""
    x, y = torch.abs(a), torch.abs(b)
    big, small = torch.maximum(x, y), torch.minimum(x, y)
    ratio = small / torch.where(big == 0, torch.ones_like(big), big)
    result = big * torch.sqrt(1 + ratio * ratio)
    # ONNX Runtime's Max and Min may drop a NaN operand: say it again, then infinities over it
    result = torch.where(torch.isnan(x) | torch.isnan(y), torch.full_like(result, math.nan), result)
    return torch.where(torch.isinf(x) | torch.isinf(y), torch.full_like(result, math.inf), result)


def erfinv(y: torch.Tensor) -> torch.Tensor:
    """Giles' single-precision approximation ("Approximating the erfinv function", 2010), then two
    Newton steps on erf (which ONNX has) to reach full precision; ±1 gives ±inf, |y| > 1 NaN."""
    w = -torch.log((1.0 - y) * (1.0 + y))
    central = w - 2.5
    p = 2.81022636e-08
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):  # fmt: skip
        p = c + p * central
    tail = torch.sqrt(torch.clamp(w, min=5.0)) - 3.0
    q = -0.000200214257
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):  # fmt: skip
        q = c + q * tail
    x = torch.where(w < 5.0, p, q) * y
    two_over_sqrt_pi = 2.0 / math.sqrt(math.pi)
    for _ in range(2):
        step = (torch.erf(x) - y) / (two_over_sqrt_pi * torch.exp(-x * x))
        x = x - torch.where(torch.isfinite(step), step, torch.zeros_like(step))
    edge = torch.where(y == 1.0, math.inf, -math.inf)
    x = torch.where(y.abs() == 1.0, edge.to(x.dtype), x)
    return torch.where(y.abs() > 1.0, torch.full_like(x, math.nan), x)


def cumprod(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Running product as a product over a lower-triangular mask: n² memory along ``dim``, but
    exact with zeros and signs (unlike exp(cumsum(log)))."""
    if dtype is not None:
        x = x.to(dtype)
    if x.dim() == 0:
        return x.clone()
    dim = dim % x.dim()
    n = x.shape[dim]
    moved = x.movedim(dim, -1)
    rows = moved.unsqueeze(-2).expand([*moved.shape[:-1], n, n])
    position = torch.arange(n, device=x.device)
    keep = position.unsqueeze(0) <= position.unsqueeze(1)  # [i, j]: x_j is in the product up to i
    product = torch.where(keep, rows, torch.ones_like(rows)).prod(-1)
    return product.movedim(-1, dim)


def _pairwise_difference(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return x1.unsqueeze(-2) - x2.unsqueeze(-3)  # [..., P, R, M]


def cdist_forward(x1: torch.Tensor, x2: torch.Tensor, p: float, compute_mode: int | None) -> torch.Tensor:
    diff = _pairwise_difference(x1, x2).abs()
    if p == 0:
        return (diff != 0).to(x1.dtype).sum(-1)
    if p == math.inf:
        return diff.amax(-1)
    if p == 1:
        return diff.sum(-1)
    if p == 2:
        return torch.sqrt((diff * diff).sum(-1))
    return diff.pow(p).sum(-1).pow(1.0 / p)


def cdist_backward(
    grad: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, p: float, cdist: torch.Tensor
) -> torch.Tensor:
    """Gradient with respect to ``x1`` (PyTorch calls it with the arguments swapped for ``x2``)."""
    diff = _pairwise_difference(x1, x2)
    dist = cdist.unsqueeze(-1)
    zero = torch.zeros_like(diff)
    if p == 0:
        return torch.zeros_like(x1)
    if p == 1:
        local = torch.sign(diff)
    elif p == 2:
        local = torch.where(dist == 0, zero, diff / dist)
    elif p == math.inf:
        local = torch.where(diff.abs() == dist, torch.sign(diff), zero)
    else:
        local = torch.sign(diff) * diff.abs().pow(p - 1) / dist.pow(p - 1)
        # As PyTorch's kernel: no gradient at zero distance, nor (p < 1) at a zero difference.
        undefined = (dist == 0) | ((diff == 0) & (p < 1))
        local = torch.where(undefined, zero, local)
    return (grad.unsqueeze(-1) * local).sum(-2)


# ONNX's ArgMax/ArgMin/ReduceMax take no booleans (session creation fails with a type error), and
# PyTorch's own backward formulas reduce boolean masks (cumprod's looks for the first zero).
def _as_uint8(x: torch.Tensor) -> torch.Tensor | None:
    return x.to(torch.uint8) if x.dtype == torch.bool else None


def _extreme_with_indices(op: Any) -> Callable[..., Any]:
    """``max.dim``/``min.dim`` of a boolean tensor, reduced as uint8."""

    def decomposition(x: torch.Tensor, dim: int, keepdim: bool = False) -> Any:
        small = _as_uint8(x)
        if small is None:
            return NotImplemented
        values, indices = op(small, dim, keepdim)
        return values.to(torch.bool), indices

    return decomposition


def _arg_extreme(op: Any) -> Callable[..., Any]:
    """``argmax``/``argmin`` of a boolean tensor, reduced as uint8."""

    def decomposition(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> Any:
        small = _as_uint8(x)
        return NotImplemented if small is None else op(small, dim, keepdim)

    return decomposition


max_dim = _extreme_with_indices(aten.max.dim)
min_dim = _extreme_with_indices(aten.min.dim)
argmax = _arg_extreme(aten.argmax.default)
argmin = _arg_extreme(aten.argmin.default)


# ``amax(x)``/``amin(x)`` with the default ``dim=()`` reduce over every dim; onnxscript's
# translation requires ``dim`` and fails export. On a 0-d tensor ONNX Runtime refuses any axis.
def _extreme_over_all(op: Any) -> Callable[..., Any]:
    def decomposition(x: torch.Tensor, dim: list[int] | tuple[int, ...] = (), keepdim: bool = False) -> Any:
        if x.dim() == 0:
            return x.clone()  # ONNX's ReduceMax/Min refuse any axis on a scalar; the result is the scalar
        if len(dim):
            return NotImplemented
        return op(x, list(range(x.dim())), keepdim)

    return decomposition


amax = _extreme_over_all(aten.amax.default)
amin = _extreme_over_all(aten.amin.default)


# ``kthvalue`` and ``mode`` have no ONNX translation.
def kthvalue(
    x: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-th smallest, the first of equal values; among equal values PyTorch's pick is unspecified."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    # ONNX's TopK puts equal values in index order, which is what a stable sort does.
    values, indices = torch.topk(x, k, dim=dim, largest=False, sorted=True)
    value, index = values.narrow(dim, k - 1, 1), indices.narrow(dim, k - 1, 1)
    if not keepdim:
        value, index = value.squeeze(dim), index.squeeze(dim)
    return value, index


def mode(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """As PyTorch's CPU kernel: the smallest of the most frequent values, at its last position."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    moved = x.movedim(dim, -1)
    n = moved.shape[-1]
    counts = (moved.unsqueeze(-1) == moved.unsqueeze(-2)).sum(-1)  # [..., n]
    frequent = counts == counts.amax(-1, keepdim=True)
    value = torch.where(frequent, moved, torch.full_like(moved, math.inf)).amin(-1, keepdim=True)
    position = torch.arange(n, device=x.device).expand(moved.shape)
    index = torch.where(moved == value, position, torch.full_like(position, -1)).amax(-1, keepdim=True)
    value, index = value.movedim(-1, dim), index.movedim(-1, dim)
    if not keepdim:
        value, index = value.squeeze(dim), index.squeeze(dim)
    return value, index


def sort_stable(
    x: torch.Tensor, *, stable: bool | None = None, dim: int = -1, descending: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sort(stable=True)`` (no ONNX translation) as a full TopK, which keeps equal values in
    index order whichever the direction, as a stable sort does."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    return torch.topk(x, x.shape[dim], dim=dim, largest=descending, sorted=True)


# ONNX Runtime's graph optimizer computes a Transpose feeding a MatMul by a 1-D vector wrongly
# (measured, onnxruntime 1.32: ``mv(a.t(), g)`` off by up to 10 with optimizations on, exact with
# them off): that is ``mv``'s own backward. Multiplying by a one-column matrix avoids that path.
def mv(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    return aten.mm.default(matrix, vector.unsqueeze(1)).squeeze(1)


def addmv(
    input: torch.Tensor, matrix: torch.Tensor, vector: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    product = mv(matrix, vector)
    if alpha != 1:
        product = product * alpha
    if beta == 0:  # as PyTorch: input is ignored, NaNs in it included
        return product.expand(torch.broadcast_shapes(input.shape, product.shape)).clone()
    return product + (input if beta == 1 else input * beta)


def addbmm(
    input: torch.Tensor,
    batch1: torch.Tensor,
    batch2: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
) -> torch.Tensor:
    """onnxscript's ``addbmm`` makes ``alpha`` and ``beta`` ONNX attributes, float32 by the format:
    a float64 model was scaled by 0.20000000298 for 0.2 (1e-7 relative off eager). As operands
    of a multiplication they are float64 constants in a float64 graph
    (:mod:`ortrain.export.double_precision_constants`). And as PyTorch, ``beta=0`` ignores
    ``input``, NaNs in it included (onnxscript's multiplied them by 0)."""
    product = torch.bmm(batch1, batch2).sum(0)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (input if beta == 1 else input * beta)


# The exporter lowers ``fmax``/``fmin`` and ``copysign`` to prims without ONNX translation
# (``prims.fmax``, ``prims.signbit``), and ``aminmax``, ``cummax``/``cummin``, ``median`` and
# ``mish_backward`` have none.
def fmax(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The maximum ignoring NaN: NaN only where both are."""
    return torch.where(torch.isnan(b), a, torch.where(torch.isnan(a), b, torch.maximum(a, b)))


def fmin(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(b), a, torch.where(torch.isnan(a), b, torch.minimum(a, b)))


def copysign(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """|a| with the sign bit of b; -0.0 counts as negative (1/-0.0 is -inf)."""
    # PyTorch's type promotion, to a floating dtype: until wave 48 (its review) the magnitude kept
    # a float32 a's dtype next to a float64 b, and a bfloat16 one's next to float32 under autocast.
    dtype = torch.result_type(a, b)
    dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
    if not isinstance(b, torch.Tensor):
        # (``torch.tensor(b)`` would be a lifted constant, which AOTAutograd refused.)
        b = torch.full((), b, dtype=dtype, device=a.device)
    magnitude = a.to(dtype).abs()  # a bool's abs has no kernel
    negative = (b < 0) | ((b == 0) & (1.0 / b < 0))
    return torch.where(negative, -magnitude, magnitude)


def aminmax(
    x: torch.Tensor, *, dim: int | None = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    dims = list(range(x.dim())) if dim is None else [dim]
    if x.dim() == 0:
        return x.clone(), x.clone()
    return aten.amin.default(x, dims, keepdim), aten.amax.default(x, dims, keepdim)


# What a masked-out position holds: a value no element is below (above). Until wave 48 (its
# review) ±inf for every dtype, which an int tensor holds as its least value whatever the sign
# (cummin of int64 gave -2**63) and a bool as True.
def _least(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _greatest(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return True
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


def _running_extreme(x: torch.Tensor, dim: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Running maximum (or minimum) and, as PyTorch's CPU kernel, the last index where it occurs
    up to each position; over a lower-triangular mask, n² along ``dim`` as ``cumprod``."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim = dim % x.dim()
    if x.shape[dim] == 0:  # nothing to reduce (eager returns empty tensors)
        return x.clone(), torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    moved = x.movedim(dim, -1)
    n = moved.shape[-1]
    rows = moved.unsqueeze(-2).expand([*moved.shape[:-1], n, n])  # [..., i, j] = x_j
    position = torch.arange(n, device=x.device)
    keep = position.unsqueeze(0) <= position.unsqueeze(1)  # j <= i
    fill = torch.full_like(rows, _least(x.dtype) if largest else _greatest(x.dtype))
    masked = torch.where(keep, rows, fill)
    values = masked.amax(-1) if largest else masked.amin(-1)
    hit = rows == values.unsqueeze(-1)
    if x.is_floating_point():
        # Once a NaN is met the running extreme is NaN, at the last NaN so far (PyTorch's kernel);
        # NaN equals nothing, so until wave 41 no position matched and the index was -1 (a
        # backward scattering at it failed).
        hit = hit | (torch.isnan(rows) & torch.isnan(values).unsqueeze(-1))
    hit = keep & hit
    indices = torch.where(hit, position.expand(rows.shape), torch.full_like(position, -1)).amax(-1)
    return values.movedim(-1, dim), indices.movedim(-1, dim)


def cummax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _running_extreme(x, dim, largest=True)


def cummin(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _running_extreme(x, dim, largest=False)


def median(x: torch.Tensor) -> torch.Tensor:
    """The lower median of all elements, as PyTorch (the ((n-1)//2)-th smallest)."""
    return median_dim(x.reshape(-1), 0)[0]


def median_dim(x: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower median along ``dim``; NaN, at the first NaN's index, where the row holds one, as
    PyTorch's (wave 37: the k-th smallest alone gave a number there, in either placement)."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    value, index = kthvalue(x, (x.shape[dim] - 1) // 2 + 1, dim, keepdim)
    if not x.is_floating_point():
        return value, index
    nan = torch.isnan(x)
    has_nan = nan.any(dim=dim, keepdim=keepdim)
    first_nan = torch.argmax(nan.to(torch.uint8), dim=dim, keepdim=keepdim)
    return torch.where(has_nan, torch.full_like(value, math.nan), value), torch.where(
        has_nan, first_nan, index
    )


def mish_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d/dx x·tanh(softplus(x)) = tanh(sp) + x·sigmoid(x)·(1 - tanh(sp)²). In float32 for half
    precision, rounded once, as PyTorch's CPU kernel (wave 48's review: rounded at every operator,
    bfloat16 gradients 5e-3 off)."""
    dtype = grad.dtype
    if dtype in (torch.float16, torch.bfloat16):
        grad, x = grad.float(), x.float()
    tanh_softplus = torch.tanh(torch.nn.functional.softplus(x))
    result = grad * (tanh_softplus + x * torch.sigmoid(x) * (1 - tanh_softplus * tanh_softplus))
    return result.to(dtype)


def weight_norm_interface_backward(
    grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norms: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``w = v * g / ||v||`` (the norm over every dim but ``dim``), as PyTorch's
    kernel computes them: ``s = sum(grad_w * v)``, ``grad_g = s / ||v||``,
    ``grad_v = g / ||v|| * (grad_w - v * s / ||v||²)``. (``weight_norm``, also Wav2Vec2's
    positional convolution, had no translation.)"""
    dims = [d for d in range(v.dim()) if d != dim % v.dim()]
    sums = (grad_w * v).sum(dims, keepdim=True) if dims else grad_w * v
    grad_v = (g / norms) * (grad_w - v * (sums / (norms * norms)))
    return grad_v, (sums / norms).reshape(g.shape)


def trilinear(
    i1: torch.Tensor,
    i2: torch.Tensor,
    i3: torch.Tensor,
    expand1: list[int],
    expand2: list[int],
    expand3: list[int],
    sumdim: list[int],
    unroll_dim: int = 1,
) -> torch.Tensor:
    """``_trilinear`` (``nn.Bilinear``, no ONNX translation): the three inputs, each unsqueezed at
    its ``expand`` dims, multiplied and summed over ``sumdim``."""
    factors = []
    for x, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        for d in sorted(expand):
            x = x.unsqueeze(d)
        factors.append(x)
    product = factors[0] * factors[1] * factors[2]
    return product.sum(sorted(sumdim)) if sumdim else product


def efficient_zero_tensor(
    size: list[int],
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    """PyTorch's backward formulas return this marker of a zero gradient (``sgn``'s for real
    inputs); ONNX has no such thing, so an ordinary tensor of zeros."""
    return torch.zeros(size, dtype=dtype, device=device)


def frexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = mantissa·2^exponent with 0.5 <= |mantissa| < 1 (0, inf and NaN: exponent 0, mantissa x).
    Computed in float64, where float32's subnormals are normal numbers; log2's rounding near a
    power of two is corrected by one step either way."""
    wide = x.to(torch.float64)
    magnitude = wide.abs()
    regular = torch.isfinite(wide) & (magnitude > 0)
    safe = torch.where(regular, magnitude, torch.ones_like(magnitude))
    exponent = torch.floor(torch.log2(safe)) + 1
    scaled = safe / torch.pow(2.0, exponent)
    exponent = torch.where(scaled >= 1, exponent + 1, torch.where(scaled < 0.5, exponent - 1, exponent))
    mantissa = wide / torch.pow(2.0, exponent)
    mantissa = torch.where(regular, mantissa, wide).to(x.dtype)
    return mantissa, torch.where(regular, exponent, torch.zeros_like(exponent)).to(torch.int32)


def nanmedian_dim(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower median of the non-NaN values along ``dim`` (NaN where all are NaN): an ascending
    TopK with NaNs as +inf, read at ((count - 1) // 2) per row."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim = dim % x.dim()
    missing = torch.isnan(x)
    filled = torch.where(missing, torch.full_like(x, math.inf), x)
    values, indices = torch.topk(filled, x.shape[dim], dim=dim, largest=False, sorted=True)
    count = (~missing).sum(dim, keepdim=True)
    position = torch.clamp(torch.div(count - 1, 2, rounding_mode="floor"), min=0)
    value, index = values.gather(dim, position), indices.gather(dim, position)
    value = torch.where(count == 0, torch.full_like(value, math.nan), value)
    if not keepdim:
        value, index = value.squeeze(dim), index.squeeze(dim)
    return value, index


def nanmedian(x: torch.Tensor) -> torch.Tensor:
    return nanmedian_dim(x.reshape(-1), 0)[0]


def relu(x: torch.Tensor) -> torch.Tensor:
    """ONNX Runtime's CPU Relu has int8 and int32 kernels only among integers; PyTorch's own
    backward formulas apply relu to int64 counts (cumprod's finds the first zero with one).
    Floating dtypes keep Relu (or the per-operator fallback, for those without a kernel)."""
    if x.is_floating_point() or x.dtype in (torch.int8, torch.int32):
        return NotImplemented
    return torch.where(x > 0, x, torch.zeros_like(x))


def broadcasting_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``copy`` of a smaller ``src`` into ``self`` (``view.copy_(src)`` after functionalization,
    as ``affine_grid``'s backward builds its base grid): onnxscript translates ``copy`` as a cast
    of ``src`` alone, which lost the broadcast, and ONNX Runtime then failed on the scatter that
    writes the copy back ("Indices and updates must have the same rank")."""
    if tuple(src.shape) == tuple(self.shape):
        return NotImplemented
    return src.to(dtype=self.dtype).expand(self.shape).clone()


_HALF = (torch.float16, torch.bfloat16)


def _in_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as PyTorch's CPU kernels read a half-precision tensor against a Python bound: in
    float32, the bound unrounded (a comparison the user writes rounds its number instead, see
    ortrain/export/rounded_number_operands.py; the kernels here do not: wave 49's review)."""
    return x.float() if x.dtype in _HALF else x


def hardtanh_backward(grad: torch.Tensor, x: torch.Tensor, min_val: float, max_val: float) -> torch.Tensor:
    """Zero where ``x`` is at or beyond a bound, as PyTorch's kernel: onnxscript's translation
    compares strictly, so ``relu6`` passed the gradient at exactly 0 and 6 (and ``hardtanh`` at ±1)."""
    held = _in_float32(x)
    return torch.where((held <= min_val) | (held >= max_val), torch.zeros_like(grad), grad)


def pdist_forward(x: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """Distances between the rows of ``x``, pairs (i < j) in row-major order: ``cdist``'s upper
    triangle."""
    n = x.shape[0]
    if n < 2:  # no pair (ONNX cannot concatenate the empty index lists)
        return x.new_zeros([0])
    rows, cols = torch.triu_indices(n, n, 1, device=x.device)
    return cdist_forward(x, x, p, None)[rows, cols]


def pdist_backward(grad: torch.Tensor, x: torch.Tensor, p: float, pdist: torch.Tensor) -> torch.Tensor:
    """Each pair's distance depends on both rows: with the gradient and the distances laid out as
    symmetric matrices, ``cdist``'s gradient with respect to its first argument counts both."""
    n = x.shape[0]
    if n < 2:
        return torch.zeros_like(x)
    rows, cols = torch.triu_indices(n, n, 1, device=x.device)

    def symmetric(values: torch.Tensor) -> torch.Tensor:
        upper = values.new_zeros([n, n]).index_put((rows, cols), values)
        return upper + upper.transpose(0, 1)

    return cdist_backward(symmetric(grad), x, x, p, symmetric(pdist))


def nextafter(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The float after ``x`` toward ``y``. The exporter's ``prims.nextafter`` has no ONNX
    translation and ONNX cannot reinterpret bits, so the step is computed: one unit in the last
    place of ``x`` (from ``frexp``), halved when moving toward zero from a power of two, never below
    the smallest subnormal; the sum is exact in float64 and so is its rounding back."""
    if x.dtype not in (torch.float32, torch.float64) or y.dtype != x.dtype:
        return NotImplemented
    info = torch.finfo(x.dtype)
    smallest = info.tiny * info.eps  # the smallest subnormal
    wide, target = (t.to(torch.float64) for t in torch.broadcast_tensors(x, y))
    mantissa, exponent = frexp(wide)
    digits = 24 if x.dtype == torch.float32 else 53  # significand bits
    step = torch.pow(2.0, (exponent - digits).to(torch.float64)).clamp_min(smallest)
    shrinking = (target > wide) != (wide > 0)
    step = torch.where(shrinking & (mantissa.abs() == 0.5), (step / 2).clamp_min(smallest), step)
    value = wide + torch.where(target > wide, step, -step)
    tiny = torch.full_like(wide, smallest)  # a Python scalar here would be rounded to float32
    value = torch.where(wide == 0, torch.where(target > 0, tiny, -tiny), value)
    value = torch.where(torch.isinf(wide), torch.sign(wide) * info.max, value)
    value = torch.where(wide == target, target, value)
    value = torch.where(torch.isnan(wide) | torch.isnan(target), math.nan, value)
    return value.to(x.dtype)


def truth_over_no_dimensions(input: torch.Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """``any``/``all`` with ``dim=()`` reduce nothing in PyTorch (each element's truth, the input's
    shape); ONNX's ``ReduceMax`` without axes reduces every axis, so the graph returned a scalar
    (a broadcast against it trained silently, a returned one failed on its rank; wave 41)."""
    if dim is None or len(dim) != 0 or input.dim() == 0:
        return NotImplemented
    truth = input.clone() if input.dtype == torch.bool else input != 0
    return truth.to(torch.uint8) if input.dtype == torch.uint8 else truth  # uint8 in, uint8 out


def mean_of_nothing(
    input: torch.Tensor,
    dim: list[int] | None = None,
    keepdim: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> Any:
    """``mean`` over no elements is NaN in PyTorch; ONNX Runtime's ReduceMean gives 0 (a masked
    loss over an empty selection read 0 where eager read NaN, and a script that skips a NaN step
    stepped on). Written as the empty sum plus NaN where the graph itself reduces a dimension of
    size 0; every other mean stays one ReduceMean, which ONNX Runtime's normalization fusions
    look for."""
    if input.dim() == 0:
        return NotImplemented
    dims = list(range(input.dim())) if not dim else [d % input.dim() for d in dim]
    if not any(is_statically_empty(input.shape[d]) for d in dims):
        return NotImplemented
    return input.sum(dims, keepdim=keepdim, dtype=dtype) + float("nan")


def spread_of_nothing(
    input: torch.Tensor,
    dim: list[int] | None = None,
    *,
    correction: float | None = None,
    keepdim: bool = False,
) -> Any:
    """``var`` and ``std`` over no elements: NaN in PyTorch, 0 from their ONNX translation."""
    del correction  # no correction makes a spread of nothing a number
    return mean_of_nothing(input, dim, keepdim)


def is_statically_empty(size: int | torch.SymInt) -> bool:
    """A size that is 0 in the graph itself (PyTorch never leaves a size of 0 open)."""
    return type(size) is int and size == 0


def _symbolic_scalar_as_tensor(operation: Callable[..., Any]) -> Callable[..., Any]:
    def with_tensor(input: torch.Tensor, other: Any) -> Any:
        if not isinstance(other, (torch.SymFloat, torch.SymInt)):
            return NotImplemented
        # The dtype a Python number of its kind gives in type promotion with ``input``.
        if input.is_floating_point() or input.is_complex() or isinstance(other, torch.SymInt):
            dtype = input.dtype
        else:
            dtype = torch.get_default_dtype()
        return operation(input, torch.scalar_tensor(other, dtype=dtype, device=input.device))

    return with_tensor


# ``tensor * (2.0 / (n - 1))`` with ``n`` a size the graph leaves open (``var``'s backward over a
# dynamic batch, VICReg's variance term): the exporter's translation of ``mul.Scalar`` takes its
# scalar as a Python float and failed on the symbolic one; as a 0-d tensor it is an ordinary input.
# ``mul.Tensor`` too: an integer tensor times such a float reaches ``mul.Scalar`` only after
# PyTorch's type promotion, below this table.
mul_by_symbolic_scalar = _symbolic_scalar_as_tensor(torch.ops.aten.mul.Tensor)
div_by_symbolic_scalar = _symbolic_scalar_as_tensor(torch.ops.aten.div.Tensor)


def roll_by_a_symbolic_shift(x: torch.Tensor, shifts: Any, dims: Any = ()) -> Any:
    """``roll`` by a shift the graph leaves open (an int argument that changes between calls, which
    TorchDynamo makes a symbol): onnxscript's translation takes the shift as an ONNX attribute,
    which a symbol cannot be, and the whole region ran in PyTorch (wave 42). PyTorch's reference,
    an index of ``(position - shift) % size``, is made of ops that translate. A number stays the
    op."""
    listed = shifts if isinstance(shifts, (list, tuple)) else (shifts,)
    if not any(isinstance(s, torch.SymInt) for s in listed):
        return NotImplemented
    return torch._refs.roll(x, shifts, dims)


def _frequency_options(dtype: torch.dtype | None, device: Any) -> dict[str, Any]:
    return {"dtype": dtype or torch.get_default_dtype(), "device": device}


def rfftfreq(
    n: int, d: float = 1.0, *, dtype: torch.dtype | None = None, device: Any = None, **_: Any
) -> torch.Tensor:
    """``torch.fft.rfftfreq`` (a spectral derivative's wave numbers), as PyTorch computes it:
    ``arange(n // 2 + 1)`` times ``1 / (n * d)``."""
    return torch.arange(n // 2 + 1, **_frequency_options(dtype, device)) * (1.0 / (n * d))


def fftfreq(
    n: int, d: float = 1.0, *, dtype: torch.dtype | None = None, device: Any = None, **_: Any
) -> torch.Tensor:
    """``torch.fft.fftfreq``: the non-negative frequencies, then the negative ones from ``-(n // 2)``,
    times ``1 / (n * d)`` as PyTorch's kernel."""
    options = _frequency_options(dtype, device)
    steps = torch.cat([torch.arange((n + 1) // 2, **options), torch.arange(-(n // 2), 0, **options)])
    return steps * (1.0 / (n * d))
