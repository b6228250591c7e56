"""Plain Python values: what a captured graph may have baked in, read and compared by value.

Numbers, strings, booleans, ``None``, and short tuples and lists of them (a conv's ``padding``, a
norm's shape). The guards read module attributes, class attributes and the module-level values a
forward names this way (:mod:`ortrain.ortmodule.guards`, :mod:`ortrain.capture.global_reads`).
Configuration objects hold such values by name and are read value by value.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any

PLAIN = frozenset({bool, int, float, str, type(None)})
SEQUENCES = frozenset({tuple, list})
SHORT = 64  # longer sequences (a vocabulary kept as a list) are watched by identity, not read
NOT_PLAIN = object()
# Configuration objects: Hugging Face's config base class (renamed in transformers 5) by name, so
# that transformers is not imported here, dataclass instances, namespaces (``args`` of argparse).
_CONFIG_BASES = frozenset({"PretrainedConfig", "PreTrainedConfig"})
_NAMESPACES = frozenset({types.SimpleNamespace, argparse.Namespace})
_is_config_type: dict[type, bool] = {}


def plain_form(value: Any) -> Any:
    """``value`` if plain, a short sequence of plain values as a tuple, else ``NOT_PLAIN``."""
    kind = type(value)
    if kind in PLAIN:
        return value
    if kind in SEQUENCES and len(value) <= SHORT and all(type(i) in PLAIN for i in value):
        return tuple(value)
    return NOT_PLAIN


def is_config_type(kind: type) -> bool:
    """Whether instances of ``kind`` are configuration objects: plain values kept by name."""
    known = _is_config_type.get(kind)
    if known is None:
        known = (
            dataclasses.is_dataclass(kind)
            or kind in _NAMESPACES
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
