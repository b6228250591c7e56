"""A capture must leave the model as it found it.

Capturing runs the model's forward on fake tensors. A forward that changes the model (a cache it
fills on first use, ``self.cos_cached = ...``; a call counter; a lazily initialized layer) then
leaves fake tensors and traced values in the model's attributes, and every later step, captured
or eager, fails on them ("Mixing fake modes", "Please convert all Tensors to FakeTensors"). And a
captured graph never repeats Python side effects, so such a change would happen at capture only.

:class:`ModuleSnapshot` records each submodule's attributes (and the contents of its tables:
parameters, buffers, submodules, hooks, and the user's lists and dicts) before a capture, and the
module-level values the forward's code names (:mod:`ortrain.capture.global_reads`: a counter, a
dict of statistics, an ``args`` namespace); :meth:`ModuleSnapshot.restore` puts them back and says
what the capture had changed, in the model's names. What ORTModule does with a change is its
business (``ortmodule.py``: that step runs in PyTorch, so the change happens once with real tensors;
a model that changes at every call trains through TorchDynamo's graph breaks).
"""

from __future__ import annotations

import array
import collections
import types
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ortrain.capture.global_reads import code_reads, global_reads
from ortrain.capture.held_objects import attributes as held_attributes
from ortrain.capture.held_objects import held_objects, is_held_object, is_pytorch_class, set_attributes
from ortrain.capture.plain_values import CONTAINER_DEPTH, PLAIN, short_entries
from ortrain.ortmodule.callback_state import callbacks, reached_state
from ortrain.ortmodule.guards import is_deepspeed_hook_state

# Values that are tables of a module: their contents are recorded, not just the table object.
# (A list a forward appends to, ``self.history.append(x.mean().item())``, kept the traced value;
# until wave 36 a deque, a bytearray or an ``array.array`` did.)
_TABLES = (dict, set, list, collections.deque, bytearray, array.array)

# Attributes that PyTorch modules rebuild from their own parameters when those are swapped, as a
# capture swaps them for graph inputs: put back, but not a change of the model. (An LSTM's flat
# weights made every capture look like a change, and the model trained through TorchDynamo, which
# hands recurrent layers back to eager PyTorch: none of it ran in ONNX Runtime.)
_DERIVED: dict[type[nn.Module], frozenset[str]] = {
    nn.RNNBase: frozenset({"_flat_weights", "_flat_weight_refs"})
}


def _derived(module: nn.Module) -> frozenset[str]:
    return next((names for kind, names in _DERIVED.items() if isinstance(module, kind)), frozenset())


@dataclass
class _Recorded:
    name: str  # the module's name in the model ("" for the model itself)
    module: nn.Module
    attributes: dict[str, Any]
    tables: dict[str, Any]  # attribute name -> a shallow copy of the table's contents


@dataclass
class _RecordedTable:
    label: str  # "nested['a'] of the model"
    table: Any  # a dict, list or set inside a module's or held object's container
    contents: list[Any]


@dataclass
class _RecordedHeld:
    label: str  # "object 'stats' held by the model"
    held: Any
    attributes: dict[str, Any]
    tables: dict[str, Any]


@dataclass
class _RecordedGlobal:
    label: str  # "global train.STATS"
    # a module's globals, a closure's cell, a class; None for a default argument (no binding)
    namespace: MutableMapping[str, Any] | None
    name: str
    value: Any
    contents: Any  # a table's contents or an object's attributes, copied; None for others


class ModuleSnapshot:
    """Every submodule's attributes at one moment, to put back after a capture."""

    def __init__(self, root: nn.Module) -> None:
        self._records: list[_Recorded] = []
        self._globals: list[_RecordedGlobal] = []
        self._held: list[_RecordedHeld] = []
        self._nested: list[_RecordedTable] = []
        # Whether :meth:`restore` found a deque with a ``maxlen`` changed (see ortmodule.py).
        self.bounded_deque_changed = False
        classes: set[type] = set()
        for name, module in root.named_modules(remove_duplicate=True):
            attributes = dict(module.__dict__)
            tables = {k: _copy(v) for k, v in attributes.items() if isinstance(v, _TABLES)}
            self._records.append(_Recorded(name, module, attributes, tables))
            classes.add(type(module))
            where = repr(name) if name else "the model"
            self._record_nested(attributes, where)
            # DeepSpeed's hooks keep their own state on the modules they hook, changed at every call.
            own = ((k, v) for k, v in attributes.items() if not is_deepspeed_hook_state(k))
            self._record_held(own, f"held by {where}")
            self._record_callbacks(attributes, where)
        read: set[tuple[int, str]] = set()
        for klass in {k for cls in classes for k in cls.__mro__ if not is_pytorch_class(k)}:
            # Tables and objects kept on the class are the instances' too (``self.STATS["calls"]
            # += 1`` on a class-level dict): until wave 30 the capture's change stayed, once.
            namespace = _ClassAttributes(klass)
            for name, value in vars(klass).items():
                if not name.startswith("__") and (isinstance(value, _TABLES) or is_held_object(value)):
                    self._record_global(f"class attribute {klass.__qualname__}.{name}", namespace, name)
        for cls in classes:
            for label, namespace, name in global_reads(cls):
                if (id(namespace), name) not in read:
                    read.add((id(namespace), name))
                    self._record_global(label, namespace, name)
            for label, namespace, name in code_reads(cls):
                function = namespace.get(name)
                if isinstance(function, types.FunctionType) and (id(function), "defaults") not in read:
                    read.add((id(function), "defaults"))
                    self._record_defaults(label, function)

    def _record_global(self, label: str, namespace: MutableMapping[str, Any], name: str) -> None:
        value = namespace.get(name, _MISSING)
        if is_held_object(value):  # ``SHARED = MaskCache()``: its attributes and their tables
            self._globals.append(_RecordedGlobal(label, namespace, name, value, None))
            self._record_held([(name, value)], f"({label})")
        else:
            self._globals.append(_RecordedGlobal(label, namespace, name, value, _contents(value)))
            # The lists and dicts inside it too (``METRICS["hist"].append(m)``: the capture's traced
            # tensors stayed in the inner list, the outer dict unchanged; wave 50's review).
            self._record_nested({name: value}, f"({label})")

    def record_reached(self, name: str, held: Any) -> None:
        """An object the capture reads below the depth recorded here (``self.run.phase.counter``,
        read as ``counter``), recorded at that first read, before the trace can change it
        (:meth:`ortrain.capture.attribute_reads.AttributeReads.recording`; until wave 36 a forward
        counting on it counted at capture only)."""
        if not any(recorded.held is held for recorded in self._held):
            self._record_held([(name, held)], "read by the forward")

    def _record_held(self, named_values: Iterable[tuple[str, Any]], where: str) -> None:
        for path, held in held_objects(named_values):
            state = dict(held_attributes(held))
            tables = {k: _copy(v) for k, v in state.items() if isinstance(v, _TABLES)}
            label = f"object {path!r} {where}"
            self._held.append(_RecordedHeld(label, held, state, tables))
            self._record_nested(state, label)

    def _record_nested(self, attributes: dict[str, Any], where: str) -> None:
        """The tables inside an object's lists, tuples and dicts, as deep as the guards read them
        (``self.nested["a"]["calls"] += 1`` in the forward: until wave 32 only the outer table's
        own entries were put back, and the count moved at capture only)."""
        for key, value in attributes.items():
            for path, table in _inner_tables(key, value, CONTAINER_DEPTH - 1):
                self._nested.append(_RecordedTable(f"{path} of {where}", table, _copy(table)))

    def _record_callbacks(self, attributes: dict[str, Any], where: str) -> None:
        """The state a module's callbacks reach (:mod:`ortrain.ortmodule.callback_state`): their
        closures' variables, and the tables and objects they are bound to or were given."""
        seen: set[int] = set()
        for name, callback in callbacks(attributes):
            for kind, found in reached_state(name, callback):
                if kind == "variable":
                    label, namespace, variable = found
                    value = namespace.get(variable, _MISSING)
                    if not isinstance(value, _NOT_STATE):
                        self._record_global(f"{label} (callback {name!r} of {where})", namespace, variable)
                    continue
                label, value = found
                if id(value) in seen or isinstance(value, _NOT_STATE):
                    continue
                seen.add(id(value))
                if isinstance(value, _TABLES):
                    where_label = f"{label} of {where}"
                    self._globals.append(_RecordedGlobal(where_label, None, "", value, _contents(value)))
                    self._record_nested({label: value}, where_label)
                elif is_held_object(value):
                    self._record_held([(label, value)], f"of {where}")

    def _record_defaults(self, label: str, function: types.FunctionType) -> None:
        """A default argument that is a table or an object (``def mask(n, _cache={})``, a cache
        filled at the first call) is state the function keeps between calls."""
        defaults = [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]
        for value in defaults:
            if isinstance(value, _TABLES):
                where = f"a default argument of {label.split()[-1]}"
                self._globals.append(_RecordedGlobal(where, None, "", value, _contents(value)))
        named = [(f"default of {label.split()[-1]}", v) for v in defaults]
        self._record_held(named, "")

    def restore(self) -> list[str]:
        """Put every recorded module back as it was; returns what had changed (empty: nothing)."""
        self.bounded_deque_changed = any(
            _is_bounded_deque(table) and not _same_contents(table, kept) for table, kept in self._tables()
        )
        changes: list[str] = []
        for record in self._records:
            derived = _derived(record.module)
            found = _changes(record, derived)
            if found or any(record.module.__dict__.get(k) is not record.attributes.get(k) for k in derived):
                _put_back(record.module, record.attributes, record.tables)
                changes += found
        for held in self._held:
            changes += _restore_held(held)
        for nested in self._nested:
            if not _same_contents(nested.table, nested.contents):
                _refill(nested.table, nested.contents)
                changes.append(f"{nested.label} changed")
        for recorded in self._globals:
            changes += _restore_global(recorded)
        return changes

    def _tables(self) -> Iterator[tuple[Any, list[Any]]]:
        """(table, its recorded contents) of every table recorded."""
        for owner in (*self._records, *self._held):
            attributes = owner.attributes
            yield from ((attributes[key], kept) for key, kept in owner.tables.items())
        yield from ((nested.table, nested.contents) for nested in self._nested)
        for recorded in self._globals:
            if isinstance(recorded.value, _TABLES) and recorded.contents is not None:
                yield recorded.value, recorded.contents


_MISSING = object()
# Values a callback's closure may hold that are not its state: the model's own modules and tensors
# (recorded as the model's), code, classes.
_NOT_STATE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType)


class _ClassAttributes(MutableMapping[str, Any]):
    """A class's own attributes as a namespace (its ``__dict__`` is read-only), for the globals'
    record and restore."""

    def __init__(self, klass: type) -> None:
        self._klass = klass

    def __getitem__(self, key: str) -> Any:
        return vars(self._klass)[key]

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self._klass, key, value)

    def __delitem__(self, key: str) -> None:
        delattr(self._klass, key)

    def __iter__(self) -> Iterator[str]:
        return iter(vars(self._klass))

    def __len__(self) -> int:
        return len(vars(self._klass))


def _changes(record: _Recorded, derived: frozenset[str]) -> list[str]:
    """What the capture changed in the module, its ``derived`` attributes left out."""
    where = repr(record.name) if record.name else "the model"
    return _attribute_changes(
        record.module.__dict__, record.attributes, record.tables, where, _same_object, skip=derived
    )


def _restore_held(recorded: _RecordedHeld) -> list[str]:
    """Put a held object's attributes (and its tables' contents) back; what the capture changed.
    A value set again equal to itself (a device, a mode string) is no change; a tensor set is."""
    current = held_attributes(recorded.held)
    found = _attribute_changes(current, recorded.attributes, recorded.tables, recorded.label, _same_value)
    if found:
        _put_back(recorded.held, recorded.attributes, recorded.tables)
    return found


def _attribute_changes(
    current: dict[str, Any],
    recorded: dict[str, Any],
    tables: dict[str, Any],
    where: str,
    same: Callable[[Any, Any], bool],
    skip: frozenset[str] = frozenset(),
) -> list[str]:
    """An object's attributes added, removed or changed since ``recorded``, and its tables whose
    contents changed, each said of ``where``."""
    found = [f"attribute {key!r} of {where} was added" for key in current.keys() - recorded.keys()]
    for key, before in recorded.items():
        if key in skip:
            continue
        after = current.get(key, _MISSING)
        if not same(before, after):
            found.append(f"attribute {key!r} of {where} was {'removed' if after is _MISSING else 'changed'}")
        elif key in tables and not _same_contents(after, tables[key]):
            found.append(f"{key.strip('_')} of {where} changed")
    return found


def _same_object(was: Any, now: Any) -> bool:
    return was is now


def _put_back(owner: Any, attributes: dict[str, Any], tables: dict[str, Any]) -> None:
    """An object's attributes as recorded (a ``__slots__`` object's too), and the recorded
    contents of the tables it held."""
    set_attributes(owner, attributes)
    for key, contents in tables.items():
        _refill(attributes[key], contents)


def _is_bounded_deque(table: Any) -> bool:
    return isinstance(table, collections.deque) and table.maxlen is not None


def _refill(table: Any, contents: list[Any]) -> None:
    if isinstance(table, list | bytearray):
        table[:] = contents
    elif isinstance(table, array.array):
        table[:] = array.array(table.typecode, contents)
    elif isinstance(table, collections.deque):
        table.clear()
        table.extend(contents)
    else:
        table.clear()
        table.update(contents)


def _same_value(was: Any, now: Any) -> bool:
    if was is now:
        return True
    kind = type(was)
    return kind is type(now) and (kind in PLAIN or kind in (torch.device, torch.dtype)) and was == now


def _contents(value: Any) -> Any:
    if isinstance(value, _TABLES):
        return _copy(value)
    attributes = getattr(value, "__dict__", None)
    return dict(attributes) if isinstance(attributes, dict) and not isinstance(value, type) else None


def _restore_global(recorded: _RecordedGlobal) -> list[str]:
    """Put one module-level value back (the name's binding, then its contents); what changed."""
    namespace, name, value = recorded.namespace, recorded.name, recorded.value
    if namespace is not None and namespace.get(name, _MISSING) is not value:
        if value is _MISSING:
            namespace.pop(name, None)
        else:
            namespace[name] = value
        return [f"{recorded.label} was changed"]
    contents = recorded.contents
    if contents is None:
        return []
    if isinstance(value, _TABLES):
        if _same_contents(value, contents):
            return []
        _refill(value, contents)
        return [f"{recorded.label} changed"]
    attributes = value.__dict__
    same = attributes.keys() == contents.keys()
    if same and all(_same_value(contents[k], attributes[k]) for k in contents):
        return []
    attributes.clear()
    attributes.update(contents)
    return [f"an attribute of {recorded.label} changed"]


def _inner_tables(path: str, value: Any, levels: int) -> Iterator[tuple[str, Any]]:
    """(path, table) of the dicts, lists and sets inside ``value``'s entries (a list or tuple
    of them, a dict of them), ``levels`` deep; not ``value`` itself."""
    entries = short_entries(value)
    if not levels or entries is None:
        return
    for key, entry in entries:
        inner = f"{path}[{key!r}]"
        if isinstance(entry, _TABLES):
            yield inner, entry
        yield from _inner_tables(inner, entry, levels - 1)


def _copy(table: Any) -> Any:
    return list(table.items()) if isinstance(table, dict) else list(table)


def _same_contents(table: Any, recorded: list[Any]) -> bool:
    now = _copy(table)
    if len(now) != len(recorded):
        return False
    if isinstance(table, dict):
        return all(k == k0 and v is v0 for (k, v), (k0, v0) in zip(now, recorded, strict=True))
    if isinstance(table, list | collections.deque):
        return all(v is v0 for v, v0 in zip(now, recorded, strict=True))
    if isinstance(table, bytearray | array.array):  # numbers, made anew at each read
        return now == recorded
    return set(now) == set(recorded)
