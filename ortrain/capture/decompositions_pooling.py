"""Pooling gradients written with ops that have ONNX translations (convolutions, scatters, matmuls).

No ONNX translation exists for ``avg_pool{2,3}d_backward``, ``adaptive_max_pool2d`` and its
backward; ``_adaptive_avg_pool2d_backward`` had one written with ``torch.tensor`` constants, which
AOTAutograd cannot trace (``lift_fresh_copy`` + ``detach_``), so sizes that do not divide failed
capture. Every constant here is built from ``arange``/``ones`` so that it traces as plain ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

aten = torch.ops.aten


def _window_counts(
    n_in: int, n_out: int, kernel: int, stride: int, padding: int, include_pad: bool, like: torch.Tensor
) -> torch.Tensor:
    """How many elements each pooling window averages over, along one axis, as exact integers:
    in bfloat16 (float16) positions above 256 (2048) round, which made divisors of 2 or 4 for 3."""
    start = torch.arange(n_out, dtype=torch.int64, device=like.device) * stride - padding
    end = torch.clamp(start + kernel, max=n_in + padding)
    if not include_pad:
        return torch.clamp(end, max=n_in) - torch.clamp(start, min=0)
    return end - start


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """PyTorch's CPU pooling kernels accumulate half types in float32 and round once at the end."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def avg_pool_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    *,
    spatial: int = 2,
) -> torch.Tensor:
    """Gradient of N-d average pooling: divide by each window's divisor, then spread each cell's
    gradient over its window with a transposed convolution by a kernel of ones."""
    kernel, stride, padding = _pool_geometry(kernel_size, stride, padding, spatial)
    in_sizes = list(input.shape[-spatial:])
    out_sizes = list(grad_output.shape[-spatial:])
    compute = _compute_dtype(grad_output.dtype)
    grad = grad_output.to(compute)
    if divisor_override:
        scaled = grad / divisor_override
    else:
        divisor = _divisor(in_sizes, out_sizes, kernel, stride, padding, count_include_pad, grad_output)
        scaled = grad / divisor.to(compute)
    batch_shape = list(grad_output.shape[:-spatial])
    if compute != grad_output.dtype:
        spread = _spread_as_eager_half(scaled.to(grad_output.dtype), kernel, stride, spatial)
    else:
        flat = scaled.reshape([-1, 1, *out_sizes])
        ones = torch.ones([1, 1, *kernel], dtype=compute, device=grad_output.device)
        spread = aten.convolution(
            flat, ones, None, stride, [0] * spatial, [1] * spatial, True, [0] * spatial, 1
        )
    # Without padding the transposed convolution covers every window; padding is cut off after.
    for axis in range(spatial):
        full = spread.shape[2 + axis]
        need = padding[axis] + in_sizes[axis]
        if full < need:
            pads = [0, 0] * (spatial - 1 - axis) + [0, need - full]
            spread = aten.constant_pad_nd(spread, pads, 0.0)
        spread = spread.narrow(2 + axis, padding[axis], in_sizes[axis])
    return spread.reshape([*batch_shape, *in_sizes]).to(grad_output.dtype)


def _spread_as_eager_half(
    delta: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], spatial: int
) -> torch.Tensor:
    """The input gradient of a bfloat16/float16 average pooling, rounded as PyTorch's CPU kernel
    rounds it: that kernel adds each window's (rounded) share into the half-precision gradient
    one window at a time, windows in row-major order, so each input element's sum is rounded
    after every term. A float32 sum rounded once is closer to exact but differs from eager by an
    ulp in about a third of the elements. One transposed convolution by one-hot kernels puts each
    kernel offset's shares in its own channel (exactly: one term per element); the channels are
    then added in the kernel's order reversed (later windows reach an element at earlier offsets),
    rounding after each add. float32 adds of two half values rounded to half are half adds."""
    count = 1
    for size in kernel:
        count *= size
    positions = torch.arange(count, device=delta.device)
    one_hot = (positions.unsqueeze(1) == positions.unsqueeze(0)).to(torch.float32)
    out_sizes = list(delta.shape[-spatial:])
    flat = delta.to(torch.float32).reshape([-1, 1, *out_sizes])
    placed = aten.convolution(
        flat,
        one_hot.reshape([1, count, *kernel]),
        None,
        stride,
        [0] * spatial,
        [1] * spatial,
        True,
        [0] * spatial,
        1,
    )
    total = placed[:, count - 1 : count]
    for offset in reversed(range(count - 1)):
        total = (total + placed[:, offset : offset + 1]).to(delta.dtype).to(torch.float32)
    return total


def _adaptive_weights(n_in: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
    """Rows are output cells, columns input positions: 1/window-size inside each cell's window."""
    out = torch.arange(n_out, device=like.device)
    start = torch.div(out * n_in, n_out, rounding_mode="floor")
    end = -torch.div(-(out + 1) * n_in, n_out, rounding_mode="floor")
    position = torch.arange(n_in, device=like.device)
    inside = (position.unsqueeze(0) >= start.unsqueeze(1)) & (position.unsqueeze(0) < end.unsqueeze(1))
    return inside.to(like.dtype) / (end - start).to(like.dtype).unsqueeze(1)


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """Gradient of adaptive average pooling: each output cell spreads its gradient evenly over its window."""
    in_h, in_w = input.shape[-2:]
    out_h, out_w = grad_output.shape[-2:]
    if in_h % out_h == 0 and in_w % out_w == 0:
        kh, kw = in_h // out_h, in_w // out_w
        scaled = grad_output / (kh * kw)
        return scaled.repeat_interleave(kh, dim=-2).repeat_interleave(kw, dim=-1)
    # Uneven windows overlap: the averaging matrices (rows = output cells) applied transposed.
    wh = _adaptive_weights(in_h, out_h, grad_output)
    ww = _adaptive_weights(in_w, out_w, grad_output)
    return torch.matmul(torch.matmul(wh.t(), grad_output), ww)


def adaptive_max_pool2d_backward(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Each output cell's gradient goes to the input element its (flat, per plane) index names."""
    plane = input.shape[-2] * input.shape[-1]
    lead = list(input.shape[:-2])
    grad = grad_output.reshape([*lead, -1])
    zeros = torch.zeros([*lead, plane], dtype=grad_output.dtype, device=grad_output.device)
    return zeros.scatter_add(-1, indices.reshape([*lead, -1]), grad).reshape(input.shape)


def _window_indices(n_in: int, n_out: int, device: torch.device) -> torch.Tensor:
    """[n_out, widest window] input positions of each adaptive window; short windows repeat their
    last position, which changes neither the maximum nor which element holds it."""
    widest = max(-(-((o + 1) * n_in) // n_out) - (o * n_in) // n_out for o in range(n_out))
    out = torch.arange(n_out, device=device)
    start = torch.div(out * n_in, n_out, rounding_mode="floor")
    end = -torch.div(-(out + 1) * n_in, n_out, rounding_mode="floor")
    offsets = torch.arange(widest, device=device)
    return torch.minimum(start.unsqueeze(1) + offsets.unsqueeze(0), (end - 1).unsqueeze(1))


def adaptive_max_pool2d(input: torch.Tensor, output_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Adaptive max pooling as a gather of every window, a max, and the winner's flat plane index."""
    in_h, in_w = input.shape[-2:]
    out_h, out_w = output_size
    if out_h == 0 or out_w == 0 or (in_h % out_h == 0 and in_w % out_w == 0) or (out_h, out_w) == (1, 1):
        from torch._decomp import decomposition_table

        return decomposition_table[aten.adaptive_max_pool2d.default](input, output_size)
    rows = _window_indices(in_h, out_h, input.device)  # [out_h, kh]
    cols = _window_indices(in_w, out_w, input.device)  # [out_w, kw]
    kh, kw = rows.shape[1], cols.shape[1]
    lead = list(input.shape[:-2])
    x = input.index_select(-2, rows.reshape(-1)).index_select(-1, cols.reshape(-1))
    x = x.reshape([*lead, out_h, kh, out_w, kw]).transpose(-3, -2).reshape([*lead, out_h, out_w, kh * kw])
    values, within = x.max(-1)
    flat = (rows.reshape(out_h, 1, kh, 1) * in_w + cols.reshape(1, out_w, 1, kw)).reshape(
        out_h, out_w, kh * kw
    )
    indices = flat.expand([*lead, out_h, out_w, kh * kw]).gather(-1, within.unsqueeze(-1)).squeeze(-1)
    return values, indices


def _pool_geometry(
    kernel_size: int | Sequence[int], stride: int | Sequence[int], padding: int | Sequence[int], spatial: int
) -> tuple[list[int], list[int], list[int]]:
    def per_axis(value: int | Sequence[int]) -> list[int]:
        values = [value] if isinstance(value, int) else list(value)
        return values * spatial if len(values) == 1 else values

    kernel = per_axis(kernel_size)
    stride = per_axis(stride) or kernel
    padding = per_axis(padding)
    return kernel, stride, padding


def _pooled_size(n_in: int, kernel: int, stride: int, padding: int, ceil_mode: bool) -> int:
    # PyTorch's pooling_output_shape: with ceil_mode the last window must start inside the input
    # or its left padding.
    span = n_in + 2 * padding - kernel
    n_out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (n_out - 1) * stride >= n_in + padding:
        n_out -= 1
    return n_out


def avg_pool(
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    spatial: int = 2,
) -> torch.Tensor:
    """N-d average pooling as a window sum (a convolution by ones) divided by each window's divisor.

    onnxscript's AveragePool ignores ``divisor_override``: a wrong result without an error. Written
    out, every option (ceil_mode, count_include_pad, divisor_override) follows PyTorch's rules.
    """
    kernel, stride, padding = _pool_geometry(kernel_size, stride, padding, spatial)
    in_sizes = list(input.shape[-spatial:])
    out_sizes = [
        _pooled_size(in_sizes[a], kernel[a], stride[a], padding[a], ceil_mode) for a in range(spatial)
    ]
    lead = list(input.shape[:-spatial])
    compute = _compute_dtype(input.dtype)
    x = input.to(compute).reshape([-1, 1, *in_sizes])
    pads: list[int] = []
    for axis in reversed(range(spatial)):
        right = max(0, (out_sizes[axis] - 1) * stride[axis] + kernel[axis] - padding[axis] - in_sizes[axis])
        pads += [padding[axis], right]
    x = aten.constant_pad_nd(x, pads, 0.0)
    ones = torch.ones([1, 1, *kernel], dtype=compute, device=input.device)
    summed = aten.convolution(x, ones, None, stride, [0] * spatial, [1] * spatial, False, [0] * spatial, 1)
    for axis in range(spatial):
        summed = summed.narrow(2 + axis, 0, out_sizes[axis])
    summed = summed.reshape([*lead, *out_sizes])
    if divisor_override:
        return (summed / divisor_override).to(input.dtype)
    divisor = _divisor(in_sizes, out_sizes, kernel, stride, padding, count_include_pad, summed)
    return (summed / divisor).to(input.dtype)


def avg_pool2d(input: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return avg_pool(input, *args, spatial=2, **kwargs)  # type: ignore[arg-type]


def avg_pool3d(input: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return avg_pool(input, *args, spatial=3, **kwargs)  # type: ignore[arg-type]


def avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor, *args: object) -> torch.Tensor:
    return avg_pool_backward(grad_output, input, *args, spatial=2)  # type: ignore[arg-type]


def avg_pool3d_backward(grad_output: torch.Tensor, input: torch.Tensor, *args: object) -> torch.Tensor:
    return avg_pool_backward(grad_output, input, *args, spatial=3)  # type: ignore[arg-type]


def _divisor(
    in_sizes: Sequence[int],
    out_sizes: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    count_include_pad: bool,
    like: torch.Tensor,
) -> torch.Tensor:
    """Each output window's element count (the average's divisor), broadcastable against ``like``,
    in ``like``'s dtype. Counts and their product are int64, exact, and rounded once at the end:
    float32/float64 hold every count; the half-precision backward passes a half ``like`` because
    eager's backward kernel divides by the count rounded to half (17 * 17 = 289 as 288 in bfloat16)
    while its forward divides in float32 by the exact count."""
    spatial = len(out_sizes)
    divisor = None
    for axis in range(spatial):
        counts = _window_counts(
            in_sizes[axis],
            out_sizes[axis],
            kernel[axis],
            stride[axis],
            padding[axis],
            count_include_pad,
            like,
        )
        counts = counts.reshape([-1] + [1] * (spatial - 1 - axis))
        divisor = counts if divisor is None else divisor * counts
    assert divisor is not None
    return divisor.to(like.dtype)


# No ONNX translation either: ``max_pool3d_with_indices_backward``, ``adaptive_max_pool3d_backward``,
# ``_adaptive_avg_pool3d`` and its backward, ``replication_pad{1,2,3}d_backward``.
def _scatter_to_planes(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor, spatial: int
) -> torch.Tensor:
    """Each output cell's gradient goes to the input element its flat (per plane) index names."""
    lead = list(input.shape[:-spatial])
    plane = 1
    for size in input.shape[-spatial:]:
        plane *= size
    zeros = torch.zeros([*lead, plane], dtype=grad_output.dtype, device=grad_output.device)
    grad = grad_output.reshape([*lead, -1])
    return zeros.scatter_add(-1, indices.reshape([*lead, -1]), grad).reshape(input.shape)


def max_pool3d_with_indices_backward(
    grad_output: torch.Tensor, input: torch.Tensor, *args: object
) -> torch.Tensor:
    indices = args[-1]
    assert isinstance(indices, torch.Tensor)
    return _scatter_to_planes(grad_output, input, indices, 3)


def adaptive_max_pool3d_backward(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    return _scatter_to_planes(grad_output, input, indices, 3)


def _apply_per_axis(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Multiply each of the trailing len(weights) axes of ``x`` by its matrix ([new, old])."""
    spatial = len(weights)
    for axis, weight in enumerate(weights):
        dim = x.dim() - spatial + axis
        x = torch.matmul(x.movedim(dim, -1), weight.t()).movedim(-1, dim)
    return x


def adaptive_avg_pool3d(input: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """Averages over each adaptive window, as one averaging matrix per axis."""
    sizes = input.shape[-3:]
    weights = [_adaptive_weights(sizes[a], output_size[a], input) for a in range(3)]
    return _apply_per_axis(input, weights)


def adaptive_avg_pool3d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    sizes, out = input.shape[-3:], grad_output.shape[-3:]
    weights = [_adaptive_weights(sizes[a], out[a], grad_output).t() for a in range(3)]
    return _apply_per_axis(grad_output, weights)


def replication_pad_backward(
    grad_output: torch.Tensor, input: torch.Tensor, padding: Sequence[int]
) -> torch.Tensor:
    """Each padded position copies the nearest edge element (clamped index), so the input's
    gradient sums, axis by axis, the output positions that copied each element. Negative padding
    crops, which the same clamped index describes."""
    spatial = len(padding) // 2
    grad = grad_output
    for axis in range(spatial):
        dim = input.dim() - 1 - axis  # padding lists the last axis first
        left = padding[2 * axis]
        n_in, n_out = input.shape[dim], grad.shape[dim]
        source = torch.clamp(torch.arange(n_out, device=grad.device) - left, 0, n_in - 1)
        moved = grad.movedim(dim, -1)
        index = source.expand(moved.shape)
        zeros = torch.zeros([*moved.shape[:-1], n_in], dtype=grad.dtype, device=grad.device)
        grad = zeros.scatter_add(-1, index, moved).movedim(-1, dim)
    return grad


def replication_pad(input: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
    """A gather of the clamped index along each padded axis: ONNX Runtime's edge-mode Pad fails
    at run time when a negative padding crops an axis ("zero effective input extent")."""
    x = input
    for axis in range(len(padding) // 2):
        dim = input.dim() - 1 - axis
        left, right = padding[2 * axis], padding[2 * axis + 1]
        n_in = x.shape[dim]
        source = torch.clamp(torch.arange(n_in + left + right, device=x.device) - left, 0, n_in - 1)
        x = x.index_select(dim, source)
    return x


# ``unfold`` (im2col) and its backward (col2im) on an empty batch: the translation reshapes to a
# shape with a 0 dimension, which ONNX Runtime refuses at session creation ("Invalid Target shape
# product of 0"). An empty input has an empty result of a shape known at capture: zeros.
def im2col(
    input: torch.Tensor,
    kernel_size: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor:
    if input.numel() != 0:
        return NotImplemented
    blocks = 1
    for i, size in enumerate(input.shape[-2:]):
        blocks *= (size + 2 * padding[i] - dilation[i] * (kernel_size[i] - 1) - 1) // stride[i] + 1
    channels = input.shape[-3] * kernel_size[0] * kernel_size[1]
    return input.new_zeros([*input.shape[:-3], channels, blocks])


def col2im(
    input: torch.Tensor,
    output_size: Sequence[int],
    kernel_size: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor:
    if input.numel() != 0:
        return NotImplemented
    channels = input.shape[-2] // (kernel_size[0] * kernel_size[1])
    return input.new_zeros([*input.shape[:-2], channels, *output_size])
