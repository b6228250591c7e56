"""uint8 class labels read as int64 while capturing, as PyTorch's loss kernels read them.

``nll_loss`` (and ``cross_entropy`` on 1-D or 2-D scores) accepts class labels of dtype int64 or
uint8. PyTorch's decomposition of ``nll_loss_forward`` (``torch._decomp``, torch 2.13), which
AOTAutograd's metadata pass runs in place of the kernel, gathers the scores with the labels
themselves, and ``gather`` takes int64 indices only: uint8 labels (a dataset that stores classes
compactly) made every capture fail, and the model trained in PyTorch for good (wave 35). While
capturing, such labels are widened to int64 before the loss sees them; the values, and so
``ignore_index`` matches, are the same. Where PyTorch refuses uint8 labels (``nll_loss2d``, for
4-D scores) the call goes through unchanged and fails as in eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F


def _widened(loss: Callable[..., Any]) -> Callable[..., Any]:
    def with_int64_labels(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        byte_labels = isinstance(target, torch.Tensor) and target.dtype == torch.uint8
        if not byte_labels or not isinstance(input, torch.Tensor) or input.dim() > 2:
            return NotImplemented
        return loss(input, target.long(), *args, **kwargs)

    return with_int64_labels


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.nll_loss: _widened(F.nll_loss),
    F.cross_entropy: _widened(F.cross_entropy),
    # TorchDynamo's graphs call the bindings under F's wrappers
    torch._C._nn.nll_loss: _widened(torch._C._nn.nll_loss),
    torch._C._nn.nll_loss_nd: _widened(torch._C._nn.nll_loss_nd),
    torch._C._nn.cross_entropy_loss: _widened(torch._C._nn.cross_entropy_loss),
}
