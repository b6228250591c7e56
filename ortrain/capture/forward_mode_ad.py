"""Whether a call carries forward-mode AD tangents (``torch.autograd.forward_ad`` dual tensors).

A captured graph computes primal values only: a dual input went through it as a plain tensor, and
the output had no tangent, which forward-mode AD reads as a zero derivative (wave 46's review: a
JVP probe under ``no_grad`` got ``None`` where eager's tangent had norm 0.47, silently; in grad
mode ortrain's own autograd Function, which has no ``jvp``, failed and sent the model to PyTorch
for good). ORTModule runs such a call in PyTorch (``ortmodule.py``), as it does under
``torch.func`` transforms, and the next plain call runs on the graphs again.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.autograd.forward_ad as forward_ad
from torch.utils._pytree import tree_leaves


def carries_tangents(arguments: object, module: torch.nn.Module) -> bool:
    """Whether a forward-AD level is open and an input, parameter, buffer or tensor attribute
    (``self.temp = make_dual(...)``, bound like a buffer) holds a tangent at it."""
    if forward_ad._current_level < 0:  # no ``dual_level()`` open: the common case costs one read
        return False
    return (
        _any_dual(tree_leaves(arguments))
        or _any_dual(module.parameters())
        or _any_dual(module.buffers())
        or _any_dual(value for m in module.modules() for value in vars(m).values())
    )


def _any_dual(values: Iterable[object]) -> bool:
    return any(isinstance(v, torch.Tensor) and forward_ad.unpack_dual(v).tangent is not None for v in values)
