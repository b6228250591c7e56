"""Plain Python values: what a captured graph may have baked in, read and compared by value.

Numbers, strings, booleans, ``None``, and short tuples and lists of them (a conv's ``padding``, a
norm's shape). The guards read module attributes, class attributes and the module-level values a
forward names this way (:mod:`ortrain.ortmodule.guards`, :mod:`ortrain.capture.global_reads`).
Configuration objects hold such values by name and are read value by value.
"""

from __future__ import annotations

import argparse
import array
import collections
import dataclasses
import numbers
import types
from collections.abc import Iterable
from typing import Any

import torch

PLAIN = frozenset({bool, int, float, str, type(None)})
SEQUENCES = frozenset({tuple, list})
# The standard library's other mutable sequences, read by value like a list (until wave 36 by
# identity: a forward scaling by the mean of ``self.recent``, a deque the loop appends the last
# losses to, kept the first mean, silently).
OTHER_SEQUENCES = frozenset({collections.deque, bytearray, array.array})
SHORT = 64  # longer tables (a vocabulary kept as a dict) are watched by identity, not read
# A list of plain values up to this long is read by value (class weights, a per-token scale):
# changed in place between steps it was not seen until wave 32 beyond 64 entries. Longer ones (a
# vocabulary kept as a list) are watched by identity; reading one costs ≈ 25 µs per 1000 entries.
LONG = 4096
# A NumPy array up to this size is read by value, as its bytes (a forward that makes a tensor of
# ``self.anchors`` bakes in its values: changed in place it was not seen until wave 32).
ARRAY_BYTES = 1 << 20
NOT_PLAIN = object()
# Containers inside containers are read this many levels deep (per-layer settings loaded from
# YAML, ``cfg["model"]["layers"][1]["scale"]``: until wave 36 two, and a change at the third was
# not seen), and up to this many entries in all; a deeper or larger one is watched by identity.
CONTAINER_DEPTH = 4
CONTAINER_ENTRIES = 1024
# Configuration objects: Hugging Face's config base class (renamed in transformers 5) and its
# generation config by name, so that transformers is not imported here, dataclass instances,
# namespaces (``args`` of argparse). (As a held object, the generation config's methods were walked
# for the globals they read at every step: GPT-2's guard 20 % slower, wave 32.)
_CONFIG_BASES = frozenset({"PretrainedConfig", "PreTrainedConfig", "GenerationConfig"})
NAMESPACES = frozenset({types.SimpleNamespace, argparse.Namespace})
_is_config_type: dict[type, bool] = {}


_number_types: dict[type, bool] = {}


def is_other_number(kind: type) -> bool:
    """Numbers of other types than Python's: NumPy scalars (``np.float32(0.5)`` from a schedule
    made with NumPy), ``Fraction``, ``Decimal``. Until wave 36 they were watched by identity: a
    schedule assigning one at every step captured at every step, and reused ids kept stale graphs
    (on a held object or a config they were not watched at all)."""
    known = _number_types.get(kind)
    if known is None:
        numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
        known = kind not in PLAIN and (issubclass(kind, numbers.Number) or numpy_bool)
        _number_types[kind] = known
    return known


def has_plain_form(kind: type) -> bool:
    """Whether :func:`plain_form` may read a value of ``kind`` (besides the plain kinds)."""
    return (
        kind in SEQUENCES
        or kind in OTHER_SEQUENCES
        or kind is torch.Size
        or kind is torch.device
        or kind.__name__ == "ndarray"
        or is_other_number(kind)
    )


def plain_form(value: Any) -> Any:
    """``value`` if plain, a tuple of plain values as itself, a list as ``("list", values)``, a NumPy array as
    ``("ndarray", dtype, shape, bytes)`` (up to :data:`LONG` entries, :data:`ARRAY_BYTES`), a
    deque of plain values as ``("deque", maxlen, values)``, a ``bytearray`` or an ``array.array``
    by its bytes, a ``torch.Size`` as a tuple, a ``torch.device`` as ``("device", name)``, another
    number (a NumPy scalar, a ``Fraction``) as ``("number", its type, its repr)``, else
    ``NOT_PLAIN``."""
    kind = type(value)
    if kind in PLAIN:
        return value
    if kind is torch.Size:
        return tuple(value)
    if kind is torch.device:  # a new object per call of ``torch.device(...)``: by value
        return ("device", str(value))
    if is_other_number(kind):
        return ("number", f"{kind.__module__}.{kind.__qualname__}", repr(value))
    if kind in SEQUENCES and len(value) <= LONG and all(type(i) in PLAIN for i in value):
        # A list as a list: ``h[self.sel]`` indexes rows by a list and one element by a tuple
        # (wave 46's review: ``sel = (0, 1)`` after ``[0, 1]`` kept the list's graph).
        return tuple(value) if kind is tuple else ("list", tuple(value))
    if kind in OTHER_SEQUENCES:
        if kind is collections.deque:
            plain = len(value) <= LONG and all(type(i) in PLAIN for i in value)
            return ("deque", value.maxlen, tuple(value)) if plain else NOT_PLAIN
        size = len(value) * (value.itemsize if kind is array.array else 1)
        if size <= ARRAY_BYTES:
            return (kind.__name__, getattr(value, "typecode", ""), bytes(value))
        return NOT_PLAIN
    if kind.__name__ == "ndarray" and kind.__module__ == "numpy" and value.nbytes <= ARRAY_BYTES:
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    return NOT_PLAIN


def short_entries(value: Any) -> Iterable[tuple[Any, Any]] | None:
    """(key or position, entry) of a dict or an exact list or tuple up to :data:`SHORT` long; None
    for anything else: the containers the guards and the capture's snapshot look into."""
    if isinstance(value, dict):
        return value.items() if len(value) <= SHORT else None
    if type(value) in SEQUENCES or type(value) is collections.deque:
        return enumerate(value) if len(value) <= SHORT else None
    return None


def is_array_form(value: Any) -> bool:
    """Whether ``value`` is :func:`plain_form`'s form of a NumPy array."""
    return type(value) is tuple and len(value) == 4 and value[0] == "ndarray" and type(value[3]) is bytes


def is_config_type(kind: type) -> bool:
    """Whether instances of ``kind`` are configuration objects: plain values kept by name."""
    known = _is_config_type.get(kind)
    if known is None:
        known = (
            dataclasses.is_dataclass(kind)
            or kind in NAMESPACES
            or any(c.__name__ in _CONFIG_BASES for c in kind.__mro__)
        )
        _is_config_type[kind] = known
    return known


def python_attributes(tensor: Any) -> tuple[tuple[str, Any], ...]:
    """The plain values a tensor carries as Python attributes (``weight.lr_scale = 2.0``, a flag
    on an input), which a forward may read like a module's; DeepSpeed's own (``ds_*``, changed at
    every step) left out. Empty for almost every tensor, and cheap to read (≈ 0.1 µs)."""
    attributes = tensor.__dict__
    if not attributes:
        return ()
    return tuple(
        (name, plain)
        for name, value in attributes.items()
        if not name.startswith("ds_") and (plain := plain_form(value)) is not NOT_PLAIN
    )
