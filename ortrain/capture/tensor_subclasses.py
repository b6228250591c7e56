"""Which ``torch.Tensor`` subclasses change what PyTorch's operators do on them.

A subclass that overrides neither ``__torch_function__`` nor ``__torch_dispatch__`` (``class
Image(torch.Tensor): pass``, a name for what a tensor holds) computes what a plain tensor
computes, and a graph can take it as one; a subclass that overrides either runs its own code
around or instead of the operators, which a captured graph would not run. ``nn.Parameter`` and
``nn.Buffer`` turn ``__torch_function__`` off (PyTorch's private ``_disabled_torch_function_impl``,
hence this module's place under ``capture/``): they are plain tensors too.
"""

from __future__ import annotations

import torch

_PROTOCOLS = ("__torch_function__", "__torch_dispatch__")


def overridden_protocols(kind: type[torch.Tensor]) -> list[str]:
    """The names of the two protocols that tensor class ``kind`` defines its own way."""
    found: list[str] = []
    for name in _PROTOCOLS:
        method = getattr(kind, name)
        plain = getattr(torch.Tensor, name)
        own = getattr(method, "__func__", method)
        if own not in (getattr(plain, "__func__", plain), torch._C._disabled_torch_function_impl):
            found.append(name)
    return found


def keeps_its_class(kind: type[torch.Tensor]) -> bool:
    """Whether PyTorch gives the results of operators on a ``kind`` that class, computed as on
    plain tensors: a subclass whose ``__torch_function__`` is ``torch.Tensor``'s own
    (``nn.Parameter``'s is turned off) and that has no ``__torch_dispatch__`` of its own."""
    own = getattr(kind.__torch_function__, "__func__", kind.__torch_function__)
    plain = torch.Tensor.__torch_function__
    default = own is getattr(plain, "__func__", plain)
    return kind is not torch.Tensor and default and not overridden_protocols(kind)
