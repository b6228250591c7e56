"""``F.one_hot`` of indices other than int64 refused while capturing, as eager PyTorch refuses them.

PyTorch's CPU kernel takes int64 indices only ("one_hot is only applicable to index tensor of type
LongTensor."); the traced formulation compares the indices with an ``arange`` and took an int32
tensor as well (wave 47's review): a model that PyTorch refuses trained under ortrain, and failed
the day it ran without it. While capturing, such a call raises eager's error, which the capture
then reports as the user's (the eager check shows PyTorch's own message).
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


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {F.one_hot: _one_hot}
