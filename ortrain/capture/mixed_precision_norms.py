"""Normalization layers with half-precision inputs and float32 parameters, captured in float32.

Under ``torch.autocast(dtype=torch.bfloat16)`` a ``Linear`` hands bfloat16 to the ``BatchNorm``
after it, whose weight and running statistics stay float32; models that keep their norms in
float32 (``model.bfloat16()`` then ``norm.float()``) do the same. PyTorch's kernels accept the
mix: they compute in float32, return the output in the input's precision and the saved mean and
inverse deviation in float32. The fake kernels that tracing runs on disagree: they give the saved
statistics the input's precision (batch, group and layer norm, torch 2.13). A captured graph
therefore described float32 values as bfloat16; where a graph was split between ONNX Runtime and
PyTorch (a gather of the counted labels cuts it, for one), ONNX Runtime made them bfloat16 and
PyTorch's ``native_batch_norm_backward`` refused them ("mixed dtype (CPU): expect parameter to have
scalar type of Float"), or ONNX Runtime received values in another precision than its graph
declared (a group norm's).

While capturing, such a call runs on the input cast to float32 and casts its output back: what
PyTorch's mixed kernel computes, with every saved value's dtype as the graph says. Layer norm
stays whole: no placement sends its mixed form to ONNX Runtime, its saved statistics only travel
between PyTorch's own kernels (which agree with each other), and casting around it changed
bfloat16 roundings where eager's kernel is matched exactly today.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

_HALF = (torch.bfloat16, torch.float16)


def _mixed(input: Any, *parameters: Any) -> bool:
    """A half-precision input with float32 parameters (any other mix PyTorch refuses itself)."""
    given = [p for p in parameters if p is not None]
    return (
        isinstance(input, torch.Tensor)
        and input.dtype in _HALF
        and bool(given)
        and all(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in given)
    )


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    if not _mixed(input, running_mean, running_var, weight, bias):
        return NotImplemented
    output = F.batch_norm(input.float(), running_mean, running_var, weight, bias, training, momentum, eps)
    return output.to(input.dtype)


def instance_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    if not _mixed(input, running_mean, running_var, weight, bias):
        return NotImplemented
    output = F.instance_norm(
        input.float(), running_mean, running_var, weight, bias, use_input_stats, momentum, eps
    )
    return output.to(input.dtype)


def group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> Any:
    if not _mixed(input, weight, bias):
        return NotImplemented
    return F.group_norm(input.float(), num_groups, weight, bias, eps).to(input.dtype)


# TorchDynamo's graphs (the graph-break path) call the functions under ``F``'s wrappers, whose
# arguments come in another order: (input, weight, bias, running_mean, running_var, training or
# use_input_stats, momentum, eps, cudnn_enabled) for batch and instance norm.
def _in_torchs_order(norm: Callable[..., Any]) -> Callable[..., Any]:
    def reordered(
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        use_batch_statistics: bool,
        momentum: float,
        eps: float,
        cudnn_enabled: bool = True,
    ) -> Any:
        return norm(input, running_mean, running_var, weight, bias, use_batch_statistics, momentum, eps)

    return reordered


def _torch_group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enabled: bool = True,
) -> Any:
    return group_norm(input, num_groups, weight, bias, eps)


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.batch_norm: batch_norm,
    F.instance_norm: instance_norm,
    F.group_norm: group_norm,
    torch.batch_norm: _in_torchs_order(batch_norm),
    torch.instance_norm: _in_torchs_order(instance_norm),
    torch.group_norm: _torch_group_norm,
}
