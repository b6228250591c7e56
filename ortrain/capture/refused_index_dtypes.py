"""Index tensors of dtypes eager PyTorch refuses, refused while capturing as eager refuses them.

PyTorch's CPU kernels take int64 indices only for ``F.one_hot`` ("one_hot is only applicable to
index tensor of type LongTensor."), and int32 or int64 for ``index_select``; the traced forms (a
comparison with an ``arange``, a gather) took an int32 one-hot index (wave 47's review) and an
int8, int16, uint8 or bool ``index_select`` index (wave 49's review) as well: a model that
PyTorch refuses trained under ortrain, and failed the day it ran without it. While capturing, such
a call raises eager's error, which the capture then reports as the user's (the eager check shows
PyTorch's own message).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F


def _one_hot(input: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(input, torch.Tensor) and input.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    return NotImplemented


def _index_select(input: Any, dim: Any, index: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(index, torch.Tensor) and index.dtype not in (torch.int32, torch.int64):
        raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")
    return NotImplemented


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.one_hot: _one_hot,
    torch.index_select: _index_select,
    torch.Tensor.index_select: _index_select,
}
