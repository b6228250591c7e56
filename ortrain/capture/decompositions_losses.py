"""Losses whose ONNX translation is imprecise, missing or wasteful.

``binary_cross_entropy_with_logits``: onnxscript computes ``log(sigmoid(x))`` and
``log(1 - sigmoid(x))``, which loses precision as ``|x|`` grows (measured: 4.5e-5 relative error on
OpInfo's sample, 35x eager's own float32 error). PyTorch's stable form is written out instead.

``nll_loss_backward`` / ``nll_loss2d_backward``: PyTorch's decomposition scatters -1 into a zeros
tensor the size of the logits, then multiplies the whole tensor by the (masked, weighted, reduced)
gradient, a full-size broadcast of ``weight`` when there is one: three passes over
(rows x classes) and two such tensors alive. Here the value each counted row receives is computed
on the row ((rows, 1)) and written by one scatter into the zeros, which ONNX Runtime runs in place.
The scatter is also the form :mod:`ortrain.capture.loss_backward` recognises to fuse it with
``log_softmax``'s backward.

``mse_loss_backward``, ``smooth_l1_loss_backward``, ``huber_loss_backward``: safe for an empty
input (below).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ortrain.capture.decompositions_math import is_statically_empty

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(loss: torch.Tensor, reduction: int) -> torch.Tensor:
    if reduction == _MEAN:
        return loss.mean()
    if reduction == _SUM:
        return loss.sum()
    return loss


def binary_cross_entropy_with_logits(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    reduction: int = _MEAN,
) -> torch.Tensor:
    # -log(sigmoid(x)) = log1p(exp(-|x|)) - min(x, 0): no cancellation for any x.
    neg_log_sigmoid = torch.log1p(torch.exp(-input.abs())) - torch.clamp(input, max=0)
    if pos_weight is not None:
        log_weight = (pos_weight - 1) * target + 1
        loss = (1 - target) * input + log_weight * neg_log_sigmoid
    else:
        loss = (1 - target) * input + neg_log_sigmoid
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


# PyTorch's NLL kernels take class indices as int64 or uint8 only ("expected target dtype to be
# Long or Byte, but got Int"); its decomposition indexes with any integer dtype, so a capture
# trained on int32 labels where eager raises (wave 34). The capture refuses them instead, and
# ORTModule's eager check then raises PyTorch's own error.
_NLL_TARGET_DTYPES = (torch.int64, torch.uint8)


def with_target_dtype_check(decomposition: Any) -> Any:
    """``decomposition`` of ``nll_loss_forward``, refusing targets PyTorch's kernel refuses."""

    @functools.wraps(decomposition)
    def checked(input: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if target.dtype not in _NLL_TARGET_DTYPES:
            raise RuntimeError(f"expected target dtype to be Long or Byte, but got {target.dtype}")
        return decomposition(input, target, *args, **kwargs)

    return checked


def nll_loss_backward(
    grad_output: torch.Tensor,
    self: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """The gradient of ``nll_loss`` (1-D/2-D input) and ``nll_loss2d`` (4-D): ``-w[t] * g`` at each
    counted target, 0 elsewhere, with the same roundings as PyTorch's decomposition."""
    channel_dim = 0 if self.dim() < 2 else 1
    grad = grad_output / total_weight if reduction == _MEAN else grad_output
    if self.dim() == 1 and target.dim() > 0:
        target = target[0]  # an unbatched input reads the first target only, as the kernel does
    target = target.unsqueeze(channel_dim)
    counted = target != ignore_index
    safe_target = torch.where(counted, target, 0)
    if self.dim() > grad.dim() > 0:
        grad = grad.unsqueeze(channel_dim)  # reduction='none': one gradient a row
    if weight is not None:
        grad = grad * weight.index_select(0, safe_target.reshape(-1)).reshape(safe_target.shape)
    row = torch.where(counted, -grad, 0).to(self.dtype)
    return torch.zeros_like(self).scatter(channel_dim, safe_target, row)


# ---- the backward of the pointwise regression losses, safe for an empty input --------------------
# PyTorch's decompositions of these divide by ``input.numel()`` in Python, and fake tensors run
# them to infer shapes: a loss over an empty selection (``mse_loss(pred[valid], y[valid])`` in a
# batch where nothing is valid, where eager PyTorch returns NaN) raised ZeroDivisionError in the
# capture, and the model fell back to PyTorch for good. An empty input's gradient is empty, so any
# scale serves there; ``sym_max`` keeps a size the graph leaves open unguarded.
#
# In half precision each follows its CPU kernel's arithmetic, compared bit for bit over 1e5
# values: ``mse_loss_backward`` and ``huber_loss_backward`` compute in the tensors' own dtype, every
# operation rounded, with the scale (2 / n, 1 / n) and the delta rounded to it first;
# ``smooth_l1_loss_backward`` computes in float32 and rounds once. (Until wave 37 all three
# computed in float32: a bfloat16 mse_loss's gradients were an ulp or two off eager's, 5 % on a
# small weight gradient.)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _mean_scale(scale: float, input: torch.Tensor, reduction: int) -> float | torch.SymFloat:
    return scale / torch.sym_max(input.numel(), 1) if reduction == _MEAN else scale


def _as_kernel_scalar(
    value: float | torch.SymFloat, like: torch.Tensor
) -> float | torch.SymFloat | torch.Tensor:
    """``value`` as a kernel holding it in the tensor's dtype: rounded to a half-precision dtype
    (a Python number multiplying a half tensor is applied in float32)."""
    if like.dtype not in _LOW_PRECISION:
        return value
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _in_opmath(function: Any) -> Any:
    """Compute in float32 for half-precision tensors and round the result."""

    @functools.wraps(function)
    def computed(grad_output: torch.Tensor, input: torch.Tensor, target: torch.Tensor, *rest: Any) -> Any:
        dtype = input.dtype
        if dtype not in _LOW_PRECISION:
            return function(grad_output, input, target, *rest)
        upcast = [t.float() for t in (grad_output, input, target)]
        return function(*upcast, *rest).to(dtype)

    return computed


def mse_loss_backward(
    grad_output: torch.Tensor, input: torch.Tensor, target: torch.Tensor, reduction: int
) -> torch.Tensor:
    scale = _as_kernel_scalar(_mean_scale(2.0, input, reduction), input)
    return scale * (input - target) * grad_output


@_in_opmath
def smooth_l1_loss_backward(
    grad_output: torch.Tensor, input: torch.Tensor, target: torch.Tensor, reduction: int, beta: float
) -> torch.Tensor:
    difference = input - target
    scaled = _mean_scale(1.0, input, reduction) * grad_output
    return torch.where(difference.abs() < beta, scaled * difference / beta, scaled * torch.sign(difference))


def huber_loss_backward(
    grad_output: torch.Tensor, input: torch.Tensor, target: torch.Tensor, reduction: int, delta: float
) -> torch.Tensor:
    difference = input - target
    scale = _as_kernel_scalar(_mean_scale(1.0, input, reduction), input)
    bound = _as_kernel_scalar(delta, input)
    return torch.where(
        difference <= -bound,
        -scale * grad_output * bound,
        torch.where(difference >= bound, scale * grad_output * bound, scale * difference * grad_output),
    )


def mean_loss_of_nothing(
    input: torch.Tensor, target: torch.Tensor, reduction: int = _MEAN, *rest: Any
) -> Any:
    """``mse_loss``, ``smooth_l1_loss``, ``huber_loss`` averaged over an empty input: NaN, as in
    PyTorch (ONNX Runtime's mean of nothing is 0); others are left to their translation."""
    if reduction != _MEAN or not any(is_statically_empty(size) for size in input.shape):
        return NotImplemented
    return (input - target).sum() + float("nan")  # the empty sum keeps the gradient's path
