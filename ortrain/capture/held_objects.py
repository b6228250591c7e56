"""Plain Python objects a model holds: a schedule, a counter, a trainer's state.

A module keeps ``self.schedule = KLSchedule()`` and its forward reads ``self.schedule.beta``,
which the training loop raises at every step; or the forward counts its calls on an object of its
own, ``self.stats.calls += 1``. A captured graph bakes in the value its trace read, and repeats
none of the forward's Python: until wave 30 the graph kept the first beta for good, and the counter
moved once, at capture, silently (the loss off by 0.6 by the fourth step).

Such objects are instances of classes that are neither PyTorch's nor the standard library's (nor
the hooks of accelerate and DeepSpeed), keeping their state in a ``__dict__``; they are found on the
modules' attributes and, up to :data:`DEPTH` levels down, on each other's
(``self.trainer.state.epoch``). The guards read their plain values at every step
(:mod:`ortrain.ortmodule.guards`); the snapshot around a capture puts them back and reports what
the trace changed (:mod:`ortrain.ortmodule.module_snapshot`).
Configuration objects (:func:`ortrain.capture.plain_values.is_config_type`) are read as before.
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from ortrain.capture.plain_values import is_config_type, short_entries

# A held object's held objects are walked whole too, and no deeper; below, the guards follow the
# objects a capture read (:mod:`ortrain.capture.attribute_reads`).
DEPTH = 2
# Packages whose objects on a module are not the model's state: PyTorch's and Python's own, and the
# hooks that accelerate and DeepSpeed attach to the modules they wrap, which record the devices
# and progress of every call (accelerate's ``_hf_hook.input_device``: each first step would have
# run eagerly and captured twice). The forward they patch in is watched by identity.
_LIBRARY_PACKAGES = frozenset(
    {"torch", "ortrain", "builtins", "accelerate", "deepspeed", *sys.stdlib_module_names}
)
# Enum members are constants of their class, compared by identity (the guards' code form).
_NOT_HELD = (
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    enum.Enum,
)
_is_held_type: dict[type, bool] = {}
_slots_of: dict[type, tuple[str, ...]] = {}


def is_held_object(value: Any) -> bool:
    """Whether ``value`` is an object whose state a forward may read: an instance of a class of the
    user's or of a library other than those above, with a ``__dict__``, that is not a
    configuration object (read as one) or a module of the model."""
    kind = type(value)
    known = _is_held_type.get(kind)
    if known is None:
        package = str(getattr(kind, "__module__", "") or "").split(".")[0]
        known = (
            package not in _LIBRARY_PACKAGES
            and not issubclass(kind, _NOT_HELD)
            and not is_config_type(kind)
            and not issubclass(kind, nn.Module)
        )
        _is_held_type[kind] = known
    return known and (isinstance(getattr(value, "__dict__", None), dict) or bool(_slot_names(kind)))


def _slot_names(kind: type) -> tuple[str, ...]:
    """The attribute names a class with ``__slots__`` (and no ``__dict__``) stores, or ()."""
    names = _slots_of.get(kind)
    if names is None:
        found: list[str] = []
        for klass in kind.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            found += [slots] if isinstance(slots, str) else list(slots)
        names = tuple(dict.fromkeys(n for n in found if n not in ("__dict__", "__weakref__")))
        _slots_of[kind] = names
    return names


def is_pytorch_class(klass: type) -> bool:
    """A class of PyTorch's (``nn.Linear``, ``nn.Module``) or ``object``: its attributes are
    constants of its code, not the model's state."""
    return str(getattr(klass, "__module__", "")).startswith(("torch.", "builtins"))


def attributes(value: Any) -> dict[str, Any]:
    """A held object's own attributes (its ``__dict__``, not read through ``__getattr__``; for a
    class with ``__slots__``, a new dict of the slots that are set)."""
    try:
        return object.__getattribute__(value, "__dict__")
    except AttributeError:  # ``__slots__`` (until wave 32 such an object was watched by identity)
        unset = object()
        found = ((name, getattr(value, name, unset)) for name in _slot_names(type(value)))
        return {name: v for name, v in found if v is not unset}


def class_attribute(kind: type, name: str, default: Any = None) -> Any:
    """What ``kind`` or a base defines under ``name``, as defined (a descriptor unbound), or
    ``default``. (A metaclass's attributes do not reach instances, and are not looked at.)"""
    return next((vars(k)[name] for k in kind.__mro__ if name in vars(k)), default)


def set_attributes(value: Any, recorded: dict[str, Any]) -> None:
    """Put a held object's attributes back as :func:`attributes` recorded them."""
    try:
        own = object.__getattribute__(value, "__dict__")
    except AttributeError:
        for name in _slot_names(type(value)):
            if name in recorded:
                object.__setattr__(value, name, recorded[name])
            elif hasattr(value, name):
                object.__delattr__(value, name)
        return
    own.clear()
    own.update(recorded)


def held_objects(named_values: Iterable[tuple[str, Any]], depth: int = DEPTH) -> Iterator[tuple[str, Any]]:
    """(path, object) of the held objects among ``named_values`` and, ``depth`` levels down, among
    their attributes (``"schedule"``, ``"trainer.state"``), each level's short lists, tuples and
    dicts looked into as well (``"schedules.1"``, as the guards read them); each object once."""
    seen: set[int] = set()
    level = list(_held_among(named_values))
    for _ in range(depth):
        following: list[tuple[str, Any]] = []
        for path, value in level:
            if id(value) in seen:
                continue
            seen.add(id(value))
            yield path, value
            following += _held_among((f"{path}.{k}", v) for k, v in attributes(value).items())
        level = following


def _held_among(named_values: Iterable[tuple[str, Any]], containers: int = 2) -> Iterator[tuple[str, Any]]:
    """The held objects among ``named_values`` and inside their short containers, ``containers``
    levels down (a dict of lists of schedules)."""
    for name, value in named_values:
        if is_held_object(value):
            yield name, value
        elif containers and (entries := short_entries(value)) is not None:
            yield from _held_among(((f"{name}.{k}", v) for k, v in entries), containers - 1)
