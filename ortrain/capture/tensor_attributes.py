"""Plain tensor attributes (``self.c = torch.tensor(...)``, neither parameter nor buffer).

AOTAutograd lifts a module's parameters and buffers to graph inputs; any other tensor the forward
reads is a real tensor closed over by the trace, which fails ("Please convert all Tensors to
FakeTensors first"). For the duration of a capture each such attribute is registered as a
non-persistent buffer of its module, so it becomes a graph input like a buffer, bound afresh at
every step: an attribute replaced by another tensor later is what the next step reads. Afterwards
the module is put back exactly as it was (the attribute in ``__dict__``, not in ``_buffers``).

An attribute the forward assigns is an output of the graph, set on the module after each run
(:mod:`ortrain.capture.attribute_assignments`): ``torch.nn.utils.spectral_norm`` sets ``weight =
weight_orig.data`` and its pre-hook assigns the normalized weight before every forward, which the
module holds afterwards, as in eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ortrain.capture.held_objects import class_attribute

# Whether values of a type are tensors, by type: ``isinstance(v, torch.Tensor)`` goes through the
# tensor metaclass (≈ 150 ns), and the guards ask it of every attribute of every module at every
# step (a module has some twenty).
_TENSOR_TYPES: dict[type, bool] = {}


def is_tensor_attribute(value: object) -> bool:
    """Whether ``value`` is a tensor that is not a parameter (what :func:`tensor_attributes` lists)."""
    kind = type(value)
    tensor = _TENSOR_TYPES.get(kind)
    if tensor is None:
        tensor = _TENSOR_TYPES[kind] = issubclass(kind, torch.Tensor)
    return tensor and not isinstance(value, nn.Parameter)


def tensor_attributes(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors in ``module.__dict__`` that are not parameters, in attribute order."""
    return [(name, value) for name, value in module.__dict__.items() if is_tensor_attribute(value)]


def storage_identity(tensor: torch.Tensor) -> int | None:
    """What two tensors that share memory have in common, real or traced (a fake or functional
    tensor's storage is an object of its own too); None for a tensor subclass without storage."""
    try:
        return StorageWeakRef(tensor.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError):
        return None


@contextlib.contextmanager
def tensor_attributes_as_buffers(root: nn.Module) -> Iterator[int]:
    """Register every module's plain tensor attributes as buffers; yields how many."""
    moved: list[tuple[nn.Module, str, torch.Tensor]] = []
    orders: list[tuple[nn.Module, list[str]]] = []
    shadowed: set[tuple[type, str]] = set()
    class_attributes = contextlib.ExitStack()
    try:
        for module in root.modules():
            attributes = tensor_attributes(module)
            if attributes:
                orders.append((module, list(module.__dict__)))
            for name, value in attributes:
                del module.__dict__[name]
                moved.append((module, name, value))
                cls = type(module)
                original = class_attribute(cls, name, _NONE)
                if original is not _NONE and (cls, name) not in shadowed:
                    shadowed.add((cls, name))
                    routed = _BufferOverClassAttribute(name, original)
                    class_attributes.enter_context(mock.patch.object(cls, name, routed))
                # Not register_buffer, which refuses a name the class has (that check is for
                # attributes the user registers by mistake).
                module._buffers[name] = value
                module._non_persistent_buffers_set.add(name)
        yield len(moved)
    finally:
        class_attributes.close()
        for module, name, value in reversed(moved):
            module._buffers.pop(name, None)
            module._non_persistent_buffers_set.discard(name)
            module.__dict__[name] = value
        for module, order in orders:
            _reorder(module.__dict__, order)


class _BufferOverClassAttribute:
    """``module.name`` during a capture, where the module's class has an attribute of that name too:
    a ``functools.cached_property`` (a causal mask built on first use) keeps its value in the
    instance's ``__dict__``, which hides the class's descriptor. Moved into ``_buffers``, the value
    is no longer found first: the descriptor computed the tensor again inside the trace, as a
    constant (until wave 31 ``register_buffer`` refused the name and the model fell back to
    PyTorch). So the lookup is routed to the buffer, for the modules that have it."""

    def __init__(self, name: str, original: Any) -> None:
        self.name = name
        self.original = original

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        buffers = obj.__dict__.get("_buffers") if obj is not None else None
        if buffers is not None and self.name in buffers:
            return buffers[self.name]
        get = getattr(type(self.original), "__get__", None)
        return get(self.original, obj, owner) if get is not None else self.original

    def __set__(self, obj: Any, value: Any) -> None:
        buffers = obj.__dict__.get("_buffers")
        if buffers is not None and self.name in buffers:
            buffers[self.name] = value
        elif hasattr(type(self.original), "__set__"):
            self.original.__set__(obj, value)
        else:
            obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        buffers = obj.__dict__.get("_buffers")
        if buffers is not None and self.name in buffers:
            del buffers[self.name]
        elif hasattr(type(self.original), "__delete__"):
            self.original.__delete__(obj)
        else:
            del obj.__dict__[self.name]


_NONE = object()


def _reorder(attributes: dict[str, object], order: list[str]) -> None:
    """Put ``attributes`` back in ``order`` (names added since go last). The state a step binds is
    read in attribute order before a capture and the graph's binding after it: attributes
    re-inserted in another order swapped two of them at every step (wave 29: a model's ``scale``
    and ``shift`` attributes, each read where the other belonged, a loss 5.44 for eager's 3.00)."""
    if list(attributes) == order[: len(attributes)]:
        return
    kept = {name: attributes[name] for name in order if name in attributes}
    kept.update((name, value) for name, value in attributes.items() if name not in kept)
    attributes.clear()
    attributes.update(kept)
