"""Ask eager PyTorch whether a failure is the user's, without changing the model.

When capture or a graph run fails, ortrain runs the wrapped module eagerly on the same inputs:
if PyTorch raises too (a wrong shape or dtype, an index out of range), that error is the one the
user must see. The check runs in the mode the user is in (no ``eval()``/``train()`` of any
submodule) without gradients, and puts back every buffer (BatchNorm statistics, counters) and the
random number generators it may have advanced (PyTorch's, Python's and NumPy's), so that the
step it stands in for leaves no trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ortrain.ortmodule.python_randomness import python_generators_kept


def run_eagerly_leaving_no_trace(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``module(*args, **kwargs)`` for its exceptions only; raises what PyTorch raises."""
    saved = [
        (m, name, buffer, buffer.clone())
        for m in module.modules()
        for name, buffer in m._buffers.items()
        if buffer is not None
    ]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda), python_generators_kept(module), torch.no_grad():
            module(*args, **kwargs)
    finally:
        with torch.no_grad():
            for m, name, buffer, copy in saved:
                m._buffers[name] = buffer  # the same tensor object, in case forward replaced it
                if buffer.shape == copy.shape:
                    buffer.copy_(copy)
                else:  # resized by the forward (a quantization observer's first call)
                    buffer.set_(copy)
