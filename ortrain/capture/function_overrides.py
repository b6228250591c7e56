"""PyTorch functions that the capture replaces by a traceable formulation, above autograd.

A decomposition table acts below autograd, after AOTAutograd's metadata pass has already run
each op on fake tensors: an op whose output shape depends on values (``_ctc_loss``'s alpha table)
fails there. A TorchFunctionMode, active only while capturing, swaps the Python-level function
for one written with static shapes, which autograd then differentiates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ortrain.capture.decompositions_ctc import ctc_loss_function
from ortrain.capture.decompositions_rnn import recurrent_overrides
from ortrain.capture.recurrent_layers import recurrent_python_ops
from ortrain.capture.storage_views import OVERRIDES as STORAGE_VIEWS


def _overrides(recurrent_as_python_ops: bool) -> dict[Callable[..., Any], Callable[..., Any]]:
    unrolled = recurrent_overrides()
    recurrent = recurrent_python_ops(unrolled) if recurrent_as_python_ops else unrolled
    # as_strided on a permuted tensor: see capture/storage_views.py
    return {torch.nn.functional.ctc_loss: ctc_loss_function, **recurrent, **STORAGE_VIEWS}


class _Overrides(TorchFunctionMode):
    def __init__(self, recurrent_as_python_ops: bool) -> None:
        super().__init__()
        self.table = _overrides(recurrent_as_python_ops)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        replacement = self.table.get(func)
        if replacement is not None:
            result = replacement(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


@contextlib.contextmanager
def function_overrides(*, recurrent_as_python_ops: bool) -> Iterator[None]:
    """``recurrent_as_python_ops``: recurrent layers over padded batches run as one opaque op each
    (:mod:`ortrain.capture.recurrent_layers`); otherwise, and for packed sequences, unrolled."""
    with _Overrides(recurrent_as_python_ops):
        yield
