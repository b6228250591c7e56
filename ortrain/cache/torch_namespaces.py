"""The entries of PyTorch's namespaces that the running script replaced (``F.relu = ...``,
``torch.relu = torch.sigmoid``, ``torch.Tensor.__mul__ = ...``): a patch applied at start-up,
depending on a configuration file say, changes what a graph computes without changing any file,
argument or variable the capture key reads.

Until wave 54 only a plain Python function from outside PyTorch under a public name counted: a
``functools.partial``, a PyTorch builtin, a callable object or a dunder loaded the unpatched
run's capture, silently. Now every entry whose object is not the one PyTorch put there counts.
What PyTorch put there is read twice:

- the namespaces as they were when this module was imported (with ``ortrain.ortmodule``, so
  before any patch made after importing ortrain): any entry whose object changed since, was
  added or was removed;
- for a patch made before that: an entry whose object does not look like PyTorch's own for that
  name (its code from outside PyTorch, a partial or callable object, or a PyTorch function found
  under another function's name, ``torch.relu = torch.sigmoid``). A few of PyTorch's own
  aliases (``torch._sync`` is ``torch._utils._functionalize_sync``) answer this too; they are the
  same objects in every process, so they only make the key a little longer.

A patch made before importing ortrain that puts a PyTorch function under its own name elsewhere
(``F.relu = torch.relu``) is not told apart from PyTorch's aliases.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

# Where a script may patch PyTorch before building its model.
WATCHED = ("torch", "torch.nn.functional", "torch.special", "torch.linalg", "torch.fft")
# Objects PyTorch adds on its own after start-up (``torch._dynamo`` once imported) are modules and
# classes, or plain data: not what a patch of a function puts there.
_NOT_PATCHES = (types.ModuleType, type, str, bytes, int, float, bool, type(None))
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType)


def _namespaces() -> list[tuple[str, dict[str, Any]]]:
    spaces = [(name, vars(sys.modules[name])) for name in WATCHED if name in sys.modules]
    spaces.append(("torch.Tensor", vars(torch.Tensor)))
    return spaces


def _same_name(space: str, name: str, own: str) -> bool:
    # ``torch.special.erf`` is ``torch._C._special.special_erf``, ``F.logsigmoid`` is
    # ``log_sigmoid``, ``Tensor.__abs__`` is ``abs``: the same function, spelled with its
    # namespace's prefix or other underscores.
    plain, own = name.replace("_", ""), own.replace("_", "")
    return own in (plain, space.rsplit(".", 1)[-1] + plain)


def _looks_patched(space: str, name: str, value: Any) -> bool:
    """Whether an entry present at import does not hold what PyTorch would put there."""
    if isinstance(value, _NOT_PATCHES) or not callable(value):
        return False
    function = getattr(value, "__func__", value)
    # A method descriptor (``Tensor.__abs__`` is ``TensorBase.abs``) names no module; its class
    # does. A partial names functools, a callable object its class's module.
    module = getattr(function, "__module__", None) or getattr(function, "__objclass__", type).__module__
    if not module.startswith("torch"):
        return not module.startswith("typing")  # typing's re-exports (``F.Optional``)
    if isinstance(function, _FUNCTIONS):
        return not _same_name(space, name, getattr(function, "__name__", name))
    return False


def _snapshot() -> dict[str, dict[str, Any]]:
    return {space: dict(namespace) for space, namespace in _namespaces()}


_AT_IMPORT = _snapshot()
_SUSPECT = {
    space: frozenset(name for name, value in entries.items() if _looks_patched(space, name, value))
    for space, entries in _AT_IMPORT.items()
}
# What a removed entry maps to.
REMOVED = object()
# ``id -> "space.name"`` of each object at import, first place (the snapshot keeps them alive).
_PLACES: dict[int, str] = {}
for _space, _entries in _AT_IMPORT.items():
    for _name, _value in _entries.items():
        if _name not in _SUSPECT[_space]:
            _PLACES.setdefault(id(_value), f"{_space}.{_name}")


def replaced_entries() -> dict[str, Any]:
    """``"space.name" -> object`` for every entry that the script may have replaced; a removed
    entry maps to :data:`REMOVED`. Cheap (it runs at every capture key): an untouched namespace
    compares equal to its snapshot in C, its objects by identity first (~0.1 ms for all)."""
    found: dict[str, Any] = {}
    for space, namespace in _namespaces():
        if space not in _AT_IMPORT:  # imported after ortrain: what it holds now is PyTorch's
            _AT_IMPORT[space] = dict(namespace)
            _SUSPECT[space] = frozenset(n for n, v in namespace.items() if _looks_patched(space, n, v))
        original, suspect = _AT_IMPORT[space], _SUSPECT[space]
        found.update((f"{space}.{name}", namespace[name]) for name in suspect if name in namespace)
        if _unchanged(namespace, original):
            continue
        for name, value in namespace.items():
            before = original.get(name, REMOVED)
            # Added by PyTorch on its own (``torch._dynamo`` once imported): not a patch.
            if value is not before and (before is not REMOVED or not isinstance(value, _NOT_PATCHES)):
                found[f"{space}.{name}"] = value
        for name in original.keys() - namespace.keys():
            found[f"{space}.{name}"] = REMOVED
    return found


def _unchanged(namespace: dict[str, Any], original: dict[str, Any]) -> bool:
    try:
        return len(namespace) == len(original) and namespace == original
    except Exception:  # an object whose ``==`` raises (a tensor): compared one by one
        return False


def original_place(value: Any) -> str | None:
    """Where PyTorch had ``value`` at import (``torch.sigmoid``), or None."""
    return _PLACES.get(id(value))
