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

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils.weak import WeakIdKeyDictionary

from ortrain.capture.plain_values import python_attributes


@contextlib.contextmanager
def python_attributes_carried() -> Iterator[None]:
    """Meanwhile, fake tensors carry the plain Python attributes of the tensors they stand for, and
    so do the functional tensors AOTAutograd wraps those in (until wave 36 a forward captured as
    written read the defaults through them: ``getattr(x, "scale", 1.0)`` kept 1.0, silently)."""
    original = FakeTensorMode.from_tensor
    original_functional = FunctionalTensor.to_functional
    # The names each fake tensor was given (not its own, ``fake_device`` and the like).
    # Keyed by identity: a tensor's ``==`` is elementwise.
    carried: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def carry(source: Any, target: Any, names: tuple[str, ...]) -> None:
        own = target.__dict__
        given = tuple(name for name in names if name not in own)
        own.update((name, source.__dict__[name]) for name in given)
        if given:
            carried[target] = given

    @functools.wraps(original)
    def from_tensor(self: FakeTensorMode, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        fake = original(self, tensor, *args, **kwargs)
        if fake is not tensor:
            # The values themselves (the key holds their plain forms: a NumPy array's bytes, a
            # device's name), and not over the fake tensor's own.
            names = carried.get(tensor) if isinstance(tensor, FakeTensor) else None
            carry(tensor, fake, names or tuple(name for name, _ in python_attributes(tensor)))
        return fake

    def to_functional(x: torch.Tensor) -> FunctionalTensor:
        wrapped = original_functional(x)
        names = carried.get(x)
        if names:
            carry(x, wrapped, names)
        return wrapped

    FakeTensorMode.from_tensor = from_tensor  # type: ignore[method-assign]
    FunctionalTensor.to_functional = staticmethod(to_functional)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        FakeTensorMode.from_tensor = original  # type: ignore[method-assign]
        FunctionalTensor.to_functional = staticmethod(original_functional)  # type: ignore[method-assign,assignment]
