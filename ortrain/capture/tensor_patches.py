"""A ``torch.Tensor`` attribute replaced while any capture runs, on every thread alike.

Class attributes cannot be set per thread: the replacement is installed when the first capture
enters and removed when the last one leaves (captures on other threads overlap), and the
replacement itself acts only where its module's thread-local state says a capture runs, doing
what PyTorch does everywhere else (``Tensor.data``'s setter: :mod:`ortrain.capture.data_assignments`;
``Tensor.as_subclass``: :mod:`ortrain.capture.subclass_views`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

_installs: dict[str, int] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def tensor_attribute_replaced(name: str, replacement: Any) -> Iterator[None]:
    """Within: ``torch.Tensor.<name>`` is ``replacement`` (PyTorch's own, inherited from the C
    base class, is back once no capture holds it)."""
    with _lock:
        if _installs.get(name, 0) == 0:
            setattr(torch.Tensor, name, replacement)
        _installs[name] = _installs.get(name, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _installs[name] -= 1
            if _installs[name] == 0:
                delattr(torch.Tensor, name)
