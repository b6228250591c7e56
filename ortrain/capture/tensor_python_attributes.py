"""Python attributes a tensor carries (``weight.lr_scale = 2.0``, a flag set on an input), seen by
the traced forward.

Capture traces the forward on fake tensors that PyTorch makes from the real ones without their
``__dict__``: ``getattr(self.weight, "lr_scale", 1.0)`` read the default while tracing, and the
graph kept it, silently (wave 30). While capturing, each fake tensor made from a real one carries
the real one's plain attributes (:func:`ortrain.capture.plain_values.python_attributes`), which
the guards key graphs by (:mod:`ortrain.ortmodule.guards`, ``ortmodule/schema.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

from ortrain.capture.plain_values import python_attributes


@contextlib.contextmanager
def python_attributes_carried() -> Iterator[None]:
    """Meanwhile, fake tensors carry the plain Python attributes of the tensors they stand for."""
    original = FakeTensorMode.from_tensor

    @functools.wraps(original)
    def from_tensor(self: FakeTensorMode, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        fake = original(self, tensor, *args, **kwargs)
        attributes = python_attributes(tensor)
        if attributes and fake is not tensor:
            fake.__dict__.update(attributes)
        return fake

    FakeTensorMode.from_tensor = from_tensor  # type: ignore[method-assign]
    try:
        yield
    finally:
        FakeTensorMode.from_tensor = original  # type: ignore[method-assign]
