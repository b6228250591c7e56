"""Which ``torch.Tensor`` subclasses change what PyTorch's operators do on them.

A subclass that overrides neither ``__torch_function__`` nor ``__torch_dispatch__`` (``class
Image(torch.Tensor): pass``, a name for what a tensor holds) computes what a plain tensor
computes, and a graph can take it as one; a subclass that overrides either runs its own code
around or instead of the operators, which a captured graph would not run. ``nn.Parameter`` and
``nn.Buffer`` turn ``__torch_function__`` off (PyTorch's private ``_disabled_torch_function_impl``,
hence this module's place under ``capture/``): they are plain tensors too.
"""

from __future__ import annotations

from typing import Any

import torch

_PROTOCOLS = ("__torch_function__", "__torch_dispatch__")


def _function(kind: type, name: str) -> Any:
    """``kind.<name>`` as the function it is (a classmethod unwrapped)."""
    method = getattr(kind, name)
    return getattr(method, "__func__", method)


def overridden_protocols(kind: type[torch.Tensor]) -> list[str]:
    """The names of the two protocols that tensor class ``kind`` defines its own way."""
    return [
        name
        for name in _PROTOCOLS
        if _function(kind, name)
        not in (_function(torch.Tensor, name), torch._C._disabled_torch_function_impl)
    ]


def keeps_its_class(kind: type[torch.Tensor]) -> bool:
    """Whether PyTorch gives the results of operators on a ``kind`` that class, computed as on
    plain tensors: a subclass that overrides neither protocol and whose ``__torch_function__`` is
    not turned off (``nn.Parameter``'s is)."""
    if kind is torch.Tensor:  # first: every input of every step asks
        return False
    switched_off = _function(kind, "__torch_function__") is torch._C._disabled_torch_function_impl
    return not switched_off and not overridden_protocols(kind)
