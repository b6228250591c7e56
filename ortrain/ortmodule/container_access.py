"""Indexing the wrapper indexes the model: ``ORTModule(nn.Sequential(...))[-1]`` is the head.

Python looks ``model[i]``, ``len(model)``, ``for layer in model`` and ``"name" in model`` up on the
class, so ORTModule's forwarding of attributes never sees them, and a wrapped ``nn.Sequential``,
``ModuleList`` or ``ModuleDict`` raised "object is not subscriptable". Each wrapped class's own
subclass of ORTModule (:mod:`ortrain.ortmodule.signature`) gets the container methods its class
has, calling the wrapped module's; writes (``model[-1] = new_head``, ``del model[0]``) also drop
the captured graphs, as an attribute written through the wrapper does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

_READS = ("__getitem__", "__len__", "__iter__", "__contains__", "__reversed__")
_WRITES = ("__setitem__", "__delitem__")


def container_methods(wrapped: type) -> dict[str, Callable[..., Any]]:
    """The container methods ``wrapped`` has beyond ``nn.Module``'s, calling the wrapped module's."""
    methods: dict[str, Callable[..., Any]] = {}
    for name in (*_READS, *_WRITES):
        if hasattr(wrapped, name) and not hasattr(nn.Module, name):
            methods[name] = _forwarded(name, writes=name in _WRITES)
    return methods


def _forwarded(name: str, *, writes: bool) -> Callable[..., Any]:
    def method(self: Any, *args: Any) -> Any:
        result = getattr(self._ortrain_module, name)(*args)
        if writes:
            self._invalidate(f"{name}() was called through the ORTModule")
        return result

    method.__name__ = method.__qualname__ = name
    return method
