"""What a callback the model holds keeps between calls: ``self.log = make_logger(store)`` (a
closure over a dict), ``functools.partial(store.__setitem__, "v")``, ``store.__setitem__``,
``lambda t: history.append(t)``, a list of such callbacks.

A forward that hands an activation to such a callback (metrics, features for another loss) writes
into state that is neither the model's attributes nor a global its code names. A capture ran the
callback on traced tensors and left them there, and the graph never calls it again: until wave 50
the store held a ``FunctionalTensor`` for good, and ``store["v"].item()`` raised (wave 50's
review). :class:`ortrain.ortmodule.module_snapshot.ModuleSnapshot` records what these callbacks
reach, puts it back after a capture and reports the change, which sends the model to the
graph-break path, where TorchDynamo calls them at every step with real tensors.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from ortrain.capture.global_reads import Read, closure_variables, is_users_function
from ortrain.capture.plain_values import short_entries

# Bound methods: Python's, C functions' (``history.append``) and slots' (``store.__setitem__``).
_BOUND = types.MethodType | types.BuiltinMethodType | types.MethodWrapperType
# A callback's reach is followed this far: a partial of a bound method of an object holding a list.
_DEPTH = 3


# A module's own tables (its hooks among them: ortrain.capture.module_hooks runs those).
_MODULE_TABLES = frozenset(nn.Module().__dict__)


def callbacks(attributes: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, callback) of the callables among a module's attributes and their short containers
    (``self.callbacks = [log, count]``); modules and classes are not callbacks here."""
    for name, value in attributes.items():
        if name in _MODULE_TABLES:
            continue
        if _is_callback(value):
            yield name, value
        elif (entries := short_entries(value)) is not None:
            yield from ((f"{name}[{key!r}]", entry) for key, entry in entries if _is_callback(entry))


def _is_callback(value: object) -> bool:
    if not isinstance(value, types.FunctionType | functools.partial | _BOUND):
        return False
    return not isinstance(getattr(value, "__self__", None), nn.Module | type | types.ModuleType)


def reached_state(name: str, callback: Any, depth: int = _DEPTH) -> Iterator[tuple[str, Read | Any]]:
    """What ``callback`` can write into between calls, as ("variable", read) for a closure's
    variable (its binding and contents) and ("value", (label, value)) for an object or a table it
    is bound to or was given (a partial's arguments, a bound method's object)."""
    if depth == 0:
        return
    if isinstance(callback, functools.partial):
        for i, value in enumerate((*callback.args, *callback.keywords.values())):
            yield "value", (f"argument {i} of callback {name!r}", value)
        yield from reached_state(name, callback.func, depth - 1)
    elif isinstance(callback, _BOUND):
        owner = callback.__self__
        if owner is not None and not isinstance(owner, nn.Module | type | types.ModuleType):
            yield "value", (f"the object of callback {name!r}", owner)
        function = getattr(callback, "__func__", None)
        if isinstance(function, types.FunctionType):
            yield from reached_state(name, function, depth - 1)
    elif isinstance(callback, types.FunctionType):
        # The module-level names its code loads (``HISTORY.append(t)``, ``global COUNT``), where
        # the code is the user's: a library's globals are its own (``partial(checkpoint, ...)``,
        # which Hugging Face models hold, reads torch's).
        namespace = callback.__globals__
        names = callback.__code__.co_names if is_users_function(callback) else ()
        for variable in names:
            if variable in namespace:
                yield "variable", (f"global {callback.__module__}.{variable}", namespace, variable)
        for read in closure_variables(callback):
            yield "variable", read
            value = read[1].get(read[2])
            if isinstance(value, types.FunctionType | functools.partial | _BOUND):
                yield from reached_state(name, value, depth - 1)
