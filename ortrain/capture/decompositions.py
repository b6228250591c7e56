"""ATen decompositions applied while capturing, for ops whose ONNX translation is missing or wrong.

Each entry is here for a measured reason (see DESIGN.md):
- ``nll_loss_forward``: onnxscript returns a fake ``total_weight`` of 1, so gradients come out too
  large by the number of targets.
- ``_native_batch_norm_legit_functional``: onnxscript hard-codes inference mode, so train-mode
  BatchNorm would export without error but wrong.
- ``native_batch_norm_backward``, ``silu_backward``, ``_adaptive_avg_pool2d_backward``,
  ``convolution_backward``: no ONNX translation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import get_decompositions

from ortrain.capture.decompositions_breaks import break_decompositions

aten = torch.ops.aten


def _conv_output_padding(
    in_size: int, out_size: int, kernel: int, stride: int, padding: int, dilation: int
) -> int:
    # The transposed convolution that maps grad_output back to the input size can land a few
    # elements short when the forward stride did not divide evenly: pad those back.
    return in_size - ((out_size - 1) * stride - 2 * padding + dilation * (kernel - 1) + 1)


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of a (non-transposed) convolution written as two forward convolutions and a sum."""
    if transposed:
        return NotImplemented
    spatial = weight.dim() - 2
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        pads = [
            _conv_output_padding(
                input.shape[2 + i],
                grad_output.shape[2 + i],
                weight.shape[2 + i],
                stride[i],
                padding[i],
                dilation[i],
            )
            for i in range(spatial)
        ]
        grad_input = aten.convolution(
            grad_output, weight, None, stride, padding, dilation, True, pads, groups
        )
    if output_mask[1]:
        # Correlate input with grad_output: the batch becomes the channel axis, and the forward
        # stride and dilation swap roles. Groups are folded into the channel axis so one
        # grouped convolution computes every group's weight gradient.
        n = input.shape[0]
        c_in_g = input.shape[1] // groups
        c_out_g = grad_output.shape[1] // groups
        in_spatial = list(input.shape[2:])
        out_spatial = list(grad_output.shape[2:])
        perm_tail = list(range(3, 3 + spatial))
        x = input.reshape([n, groups, c_in_g, *in_spatial]).permute([2, 1, 0, *perm_tail])
        x = x.reshape([c_in_g, groups * n, *in_spatial])
        g = grad_output.reshape([n, groups, c_out_g, *out_spatial]).permute([1, 2, 0, *perm_tail])
        g = g.reshape([groups * c_out_g, n, *out_spatial])
        gw = aten.convolution(x, g, None, dilation, padding, stride, False, [0] * spatial, groups)
        for i in range(spatial):
            gw = gw.narrow(2 + i, 0, weight.shape[2 + i])
        grad_weight = gw.transpose(0, 1).contiguous()
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, 2 + spatial)])
    return grad_input, grad_weight, grad_bias


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """Gradient of adaptive average pooling: each output cell spreads its gradient evenly over its window."""
    in_h, in_w = input.shape[-2:]
    out_h, out_w = grad_output.shape[-2:]
    if in_h % out_h == 0 and in_w % out_w == 0:
        kh, kw = in_h // out_h, in_w // out_w
        scaled = grad_output / (kh * kw)
        return scaled.repeat_interleave(kh, dim=-2).repeat_interleave(kw, dim=-1)

    # Uneven windows overlap: build the averaging matrices (rows = output cells) explicitly.
    def weights(n_in: int, n_out: int) -> torch.Tensor:
        rows = []
        for o in range(n_out):
            start = (o * n_in) // n_out
            end = -((-(o + 1) * n_in) // n_out)
            row = [0.0] * n_in
            for i in range(start, end):
                row[i] = 1.0 / (end - start)
            rows.append(row)
        return torch.tensor(rows, dtype=grad_output.dtype, device=grad_output.device)

    wh = weights(in_h, out_h)
    ww = weights(in_w, out_w)
    return torch.matmul(torch.matmul(wh.t(), grad_output), ww)


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    table = get_decompositions(
        [
            aten.nll_loss_forward,
            aten._native_batch_norm_legit_functional,
            aten.native_batch_norm_backward,
            aten.silu_backward,
        ]
    )
    table[aten.convolution_backward.default] = convolution_backward
    table[aten._adaptive_avg_pool2d_backward.default] = adaptive_avg_pool2d_backward
    table.update(break_decompositions())
    return table
