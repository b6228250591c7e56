"""ATen decompositions applied while capturing, for ops whose ONNX translation is missing or wrong.

Each entry is here for a measured reason (see DESIGN.md):
- ``nll_loss_forward``: onnxscript returns a fake ``total_weight`` of 1, so gradients come out
  too large by the number of targets.
- ``pixel_shuffle`` / ``pixel_unshuffle`` (the other's backward): onnxscript's reshapes with a
  -1, which ONNX Runtime refuses on an empty tensor; PyTorch's own forms give every size.
- (``convolution_backward``, training-mode batch norm, ``silu_backward``, and the special
  functions written for ONNX (``hypot``, ``erfinv``, the ``erfc`` family, ``ndtri``, the gamma
  functions, the modified Bessel functions) are decomposed when a region is exported, so that
  PyTorch runs its own kernels for them elsewhere: :mod:`ortrain.capture.late_decompositions`.)
- pooling (``decompositions_pooling``), elementwise and distance ops (``decompositions_math``),
  ``embedding_bag`` (``decompositions_embedding``), losses and the NLL gradient
  (``decompositions_losses``), 0-d
  scatters and gathers
  (``decompositions_indexing``), view-scatters such as the backward of ``diagonal``
  (``decompositions_view_scatter``), dropout's gradient on CPU (``decompositions_dropout``):
  each module says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import get_decompositions

from ortrain.capture import decompositions_dropout as dropout
from ortrain.capture import decompositions_embedding as embedding
from ortrain.capture import decompositions_gathers as gathers
from ortrain.capture import decompositions_indexing as indexing
from ortrain.capture import decompositions_losses as losses
from ortrain.capture import decompositions_math as math_ops
from ortrain.capture import decompositions_pooling as pooling
from ortrain.capture import decompositions_view_scatter as view_scatter
from ortrain.capture.decompositions_breaks import break_decompositions

aten = torch.ops.aten


def _conv_output_padding(
    in_size: int, out_size: int, kernel: int, stride: int, padding: int, dilation: int
) -> int:
    # The transposed convolution that maps grad_output back to the input size can land a few
    # elements short when the forward stride did not divide evenly: pad those back.
    return in_size - ((out_size - 1) * stride - 2 * padding + dilation * (kernel - 1) + 1)


def _weight_grad(
    input: torch.Tensor,
    grad_output: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """Weight gradient of ``grad_output = conv(input, w)``, shaped [out channels, in/groups, *kernel].

    Correlate input with grad_output: the batch becomes the channel axis, and the forward stride
    and dilation swap roles. Groups are folded into the channel axis so one grouped convolution
    computes every group's weight gradient.
    """
    spatial = len(kernel)
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
        gw = gw.narrow(2 + i, 0, kernel[i])
    return gw.transpose(0, 1).contiguous()


def input_gradient_of_any_size(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    in_sizes: Sequence[Any],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """The input gradient where the output padding depends on a dynamic size (a strided
    convolution over a length that changes: whether the stride divides it varies). ONNX's
    ConvTranspose takes output padding as an attribute, a fixed number. So: the transposed
    convolution without padding (every input position any output read), zeros after it for the
    trailing positions the stride skipped (at most ``stride - 1 - padding`` of them), then the
    input's own window, ``padding`` in."""
    spatial = len(in_sizes)
    full = aten.convolution(
        grad_output, weight, None, stride, [0] * spatial, dilation, True, [0] * spatial, groups
    )
    tail = [max(0, stride[i] - 1 - padding[i]) for i in range(spatial)]
    for i in range(spatial):
        if tail[i]:
            # Zeros joined on, not constant_pad_nd: traced at export on the capture's fake values,
            # its kernel read the sizes as integers and fixed the batch size of a dynamic capture
            # to its example value (wave 43: a ResNet's backward exported for batch 3 only).
            zeros_shape = [*full.shape[: 2 + i], tail[i], *full.shape[3 + i :]]
            full = torch.cat([full, full.new_zeros(zeros_shape)], dim=2 + i)
    for i in range(spatial):
        full = full.narrow(2 + i, padding[i], in_sizes[i])
    return full


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
    """Gradients of a convolution written as two forward convolutions and a sum.

    A transposed convolution is the adjoint of the ordinary convolution by the same weight, so its
    input gradient is that ordinary convolution of grad_output, and its weight gradient is the
    ordinary convolution's weight gradient with input and grad_output swapped.
    """
    spatial = weight.dim() - 2
    kernel = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution(
                grad_output, weight, None, stride, padding, dilation, False, [0] * spatial, groups
            )
            # An output padding of at least the stride (PyTorch allows it below the dilation)
            # adds output_padding // stride positions the adjoint convolution reads back: the
            # input's size is L + output_padding // stride of them (wave 37: a shape mismatch
            # that made ONNX Runtime refuse the backward region).
            for i in range(spatial):
                if output_padding[i] >= stride[i]:
                    grad_input = grad_input.narrow(2 + i, 0, input.shape[2 + i])
        else:
            pads = [
                _conv_output_padding(
                    input.shape[2 + i],
                    grad_output.shape[2 + i],
                    kernel[i],
                    stride[i],
                    padding[i],
                    dilation[i],
                )
                for i in range(spatial)
            ]
            if all(isinstance(pad, int) for pad in pads):
                grad_input = aten.convolution(
                    grad_output, weight, None, stride, padding, dilation, True, pads, groups
                )
            else:
                grad_input = input_gradient_of_any_size(
                    grad_output, weight, list(input.shape[2:]), stride, padding, dilation, groups
                )
    if output_mask[1]:
        if transposed:
            grad_weight = _weight_grad(grad_output, input, kernel, stride, padding, dilation, groups)
        else:
            grad_weight = _weight_grad(input, grad_output, kernel, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, 2 + spatial)])
    return grad_input, grad_weight, grad_bias


def refuse_sparse(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Sparse layouts do not survive the capture: measured with ``x.to_sparse().to_dense()`` under
    per-operator fallback, the output came back without a gradient (a silently zero gradient).
    Refused at capture, so the fallback policy lets PyTorch run such a model."""
    raise NotImplementedError(
        "ortrain does not train through sparse tensors (to_sparse and related conversions); "
        "keep tensors dense or let PyTorch run the model"
    )


def random_from_to(
    x: torch.Tensor, low: int, high: int | None = None, *, generator: torch.Generator | None = None
) -> Any:
    """``x.random_(low, high)`` as ``randint_like``, which draws the same numbers (it fills an
    ``empty_like`` with ``random_``): the functional ``aten.random.from`` is named after a Python
    keyword, and torch.fx writes it into the code it generates for a region, which then does not
    compile ("invalid syntax")."""
    if high is None or generator is not None:
        return NotImplemented
    return aten.randint_like.low_dtype(x, low, high)


def _first_of(*decompositions: Callable[..., Any]) -> Callable[..., Any]:
    """The first of ``decompositions`` that applies (does not return NotImplemented)."""

    def decomposition(*args: Any, **kwargs: Any) -> Any:
        for candidate in decompositions:
            result = candidate(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return NotImplemented

    return decomposition


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    # Convolution backward, training-mode batch norm, SiLU's backward and the special functions
    # are decomposed at export instead (ortrain.capture.late_decompositions): PyTorch runs them as
    # its own kernels.
    # pixel_(un)shuffle: onnxscript reshapes with a -1, which ONNX refuses on an empty tensor
    table = get_decompositions([aten.nll_loss_forward, aten.pixel_shuffle, aten.pixel_unshuffle])
    nll = aten.nll_loss_forward.default
    table[nll] = losses.with_target_dtype_check(table[nll])
    table.update(indexing.scalar_indexing_table())
    table[aten.scatter_reduce.two] = _first_of(table[aten.scatter_reduce.two], gathers.scatter_reduce_mean)
    table[aten._adaptive_avg_pool2d_backward.default] = pooling.adaptive_avg_pool2d_backward
    table[aten.avg_pool2d.default] = pooling.avg_pool2d
    table[aten.avg_pool3d.default] = pooling.avg_pool3d
    table[aten.avg_pool2d_backward.default] = pooling.avg_pool2d_backward
    table[aten.avg_pool3d_backward.default] = pooling.avg_pool3d_backward
    table[aten.max.dim] = math_ops.max_dim
    table[aten.min.dim] = math_ops.min_dim
    table[aten.argmax.default] = math_ops.argmax
    table[aten.argmin.default] = math_ops.argmin
    table[aten.amax.default] = math_ops.amax
    table[aten.amin.default] = math_ops.amin
    table[aten.adaptive_max_pool2d.default] = pooling.adaptive_max_pool2d
    table[aten.adaptive_max_pool2d_backward.default] = pooling.adaptive_max_pool2d_backward
    table[aten.max_pool3d_with_indices_backward.default] = pooling.max_pool3d_with_indices_backward
    table[aten.adaptive_max_pool3d_backward.default] = pooling.adaptive_max_pool3d_backward
    table[aten._adaptive_avg_pool3d.default] = pooling.adaptive_avg_pool3d
    table[aten._adaptive_avg_pool3d_backward.default] = pooling.adaptive_avg_pool3d_backward
    table[aten.im2col.default] = pooling.im2col
    table[aten.col2im.default] = pooling.col2im
    for pad_backward in (
        aten.replication_pad1d_backward,
        aten.replication_pad2d_backward,
        aten.replication_pad3d_backward,
    ):
        table[pad_backward.default] = pooling.replication_pad_backward
    for pad in (aten.replication_pad1d, aten.replication_pad2d, aten.replication_pad3d):
        table[pad.default] = pooling.replication_pad
    table[aten.binary_cross_entropy_with_logits.default] = losses.binary_cross_entropy_with_logits
    table[aten.nll_loss_backward.default] = losses.nll_loss_backward
    table[aten.nll_loss2d_backward.default] = losses.nll_loss_backward
    table[aten.mean.default] = math_ops.mean_of_nothing
    table[aten.any.dims] = math_ops.truth_over_no_dimensions
    table[aten.all.dims] = math_ops.truth_over_no_dimensions
    table[aten.mean.dim] = math_ops.mean_of_nothing
    table[aten.var.correction] = math_ops.spread_of_nothing
    table[aten.mul.Scalar] = math_ops.mul_by_symbolic_scalar
    table[aten.mul.Tensor] = math_ops.mul_by_symbolic_scalar
    table[aten.div.Scalar] = math_ops.div_by_symbolic_scalar
    table[aten.std.correction] = math_ops.spread_of_nothing
    for regression_loss in (aten.mse_loss, aten.smooth_l1_loss, aten.huber_loss):
        table[regression_loss.default] = losses.mean_loss_of_nothing
    table[aten.mse_loss_backward.default] = losses.mse_loss_backward
    table[aten.smooth_l1_loss_backward.default] = losses.smooth_l1_loss_backward
    table[aten.huber_loss_backward.default] = losses.huber_loss_backward
    table[aten.roll.default] = math_ops.roll_by_a_symbolic_shift
    table[aten.mv.default] = math_ops.mv
    table[aten.addmv.default] = math_ops.addmv
    table[aten.addbmm.default] = math_ops.addbmm
    table[aten.kthvalue.default] = math_ops.kthvalue
    table[aten.sort.stable] = math_ops.sort_stable
    table[aten.mode.default] = math_ops.mode
    table[aten.fmax.default] = math_ops.fmax
    table[aten.fmin.default] = math_ops.fmin
    table[aten.copysign.Tensor] = math_ops.copysign
    table[aten.copysign.Scalar] = math_ops.copysign
    table[aten.aminmax.default] = math_ops.aminmax
    table[aten.cummax.default] = math_ops.cummax
    table[aten.cummin.default] = math_ops.cummin
    table[aten.median.default] = math_ops.median
    table[aten.median.dim] = math_ops.median_dim
    table[aten._trilinear.default] = math_ops.trilinear
    table[aten.frexp.Tensor] = math_ops.frexp
    for to_sparse in (aten._to_sparse.default, aten._to_sparse.sparse_dim, aten._to_sparse_csr.default):
        table[to_sparse] = refuse_sparse
    table[aten.relu.default] = math_ops.relu
    table[aten.hardtanh_backward.default] = math_ops.hardtanh_backward
    table[aten.copy.default] = math_ops.broadcasting_copy
    table[aten.nanmedian.default] = math_ops.nanmedian
    table[aten.nanmedian.dim] = math_ops.nanmedian_dim
    table[aten._efficientzerotensor.default] = math_ops.efficient_zero_tensor
    table[aten.put.default] = gathers.put
    table[aten.take.default] = gathers.take
    table[aten.index_reduce.default] = gathers.index_reduce
    table[aten.mish_backward.default] = math_ops.mish_backward
    table[aten._weight_norm_interface_backward.default] = math_ops.weight_norm_interface_backward
    table[aten.cumprod.default] = math_ops.cumprod
    table[aten._cdist_forward.default] = math_ops.cdist_forward
    table[aten._cdist_backward.default] = math_ops.cdist_backward
    table[aten._pdist_forward.default] = math_ops.pdist_forward
    table[aten._pdist_backward.default] = math_ops.pdist_backward
    table[aten.nextafter.default] = math_ops.nextafter
    table[aten.fft_rfftfreq.default] = math_ops.rfftfreq
    table[aten.fft_fftfreq.default] = math_ops.fftfreq
    table[aten.masked_scatter_backward.default] = gathers.masked_scatter_backward
    table[aten._embedding_bag.default] = embedding.embedding_bag
    table[aten._embedding_bag_forward_only.default] = embedding.embedding_bag
    table[aten._embedding_bag_backward.default] = embedding.embedding_bag_backward
    table[aten._embedding_bag_dense_backward.default] = embedding.embedding_bag_dense_backward
    table[aten._embedding_bag_per_sample_weights_backward.default] = (
        embedding.embedding_bag_per_sample_weights_backward
    )
    table[aten.native_dropout_backward.default] = dropout.native_dropout_backward
    table[getattr(aten.random, "from")] = random_from_to  # `from` is a keyword
    table.update(view_scatter.view_scatter_table())
    table.update(break_decompositions())
    return table
