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
"""

from __future__ import annotations

import torch

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
