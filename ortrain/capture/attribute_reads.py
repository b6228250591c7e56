"""Which attributes of the objects a model holds its forward reads, recorded while it is traced.

The guards watch the plain values of the objects a model holds (a schedule, ``self.trainer.state``:
:mod:`ortrain.capture.held_objects`) and of its dataclass configs: a graph bakes in what its trace
read. Most such objects also keep values the forward never reads, and some of those change at
every step: a meter the training loop updates (``model.meter.update(loss.item())``), a data set's
epoch, a back-reference to the loop's own state. Until wave 31 each such change captured the model
again, at every step (0.1 s a step for an MLP, seconds for a GPT), with nothing but an INFO line to
say so.

So each capture records, per object, the names its trace read (``getattr``, ``self.x`` inside the
object's methods and properties: every lookup through the object's class), and the guards watch
those values only, and the object's identity; a value read through ``__dict__`` or ``vars()``
counts as reading all of them. An object no capture has traced yet is watched whole, as is one
whose class looks attributes up its own way (a ``__getattribute__`` or ``__getattr__``: Hugging
Face's configs map names to others behind it), whose class cannot be patched, or that cannot be
referenced weakly. Names only grow while an object stays in the model: a later capture that reads
more (another branch) adds them, so that the keys settle. Each graph is kept under a key computed
after its capture, which therefore holds every name that capture read: a later key equals it only
where those values are the same.

This is what TorchDynamo's guards do for the attributes a frame reads; ortrain's capture traces
with AOTAutograd, which runs the forward's Python as it is, so the lookups are recorded by wrapping
``__getattribute__`` on the objects' classes for the duration of the capture.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock

from ortrain.capture.held_objects import is_held_object

# Lookups that hand out every value at once (a copy, a pickle, ``vars(obj)``).
_WHOLE = frozenset({"__dict__", "__getstate__", "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__"})
_recordable_class: dict[type, bool] = {}


class _Absent:
    """The value, in a key, of a name a capture read that the object does not have (now)."""

    def __repr__(self) -> str:
        return "<unset>"


ABSENT = _Absent()


def is_recordable(value: Any) -> bool:
    """Whether lookups on ``value`` can be recorded: its class is a Python class that looks
    attributes up the ordinary way, and ``value`` has a ``__dict__`` and takes weak references."""
    kind = type(value)
    known = _recordable_class.get(kind)
    if known is None:
        custom_lookup = any(
            "__getattribute__" in vars(klass) or "__getattr__" in vars(klass) for klass in kind.__mro__[:-1]
        )
        known = not custom_lookup and kind.__module__ not in ("builtins", "types", "argparse")
        _recordable_class[kind] = known
    if not known or not isinstance(getattr(value, "__dict__", None), dict):
        return False
    try:
        weakref.ref(value)
    except TypeError:
        return False
    return True


class AttributeReads:
    """One model's record: for each object its captures traced, the names they read."""

    def __init__(self) -> None:
        # id -> (a weak reference, the names); the reference tells the object from a dead one
        # whose id was reused.
        self._names: dict[int, tuple[weakref.ref[Any], tuple[str, ...]]] = {}
        self.version = 0  # changes whenever :meth:`names` may answer differently
        self._on_reach: Callable[[str, Any], None] | None = None

    @contextlib.contextmanager
    def reaching(self, callback: Callable[[str, Any], None]) -> Iterator[None]:
        """Within the block, each object a recording reaches below those it was given is handed to
        ``callback(name, obj)`` (``obj`` was read as attribute ``name``) at its first read."""
        self._on_reach = callback
        try:
            yield
        finally:
            self._on_reach = None

    def names(self, value: Any) -> tuple[str, ...] | None:
        """The names of ``value``'s attributes that captures read (sorted), or None: all of them."""
        found = self._names.get(id(value))
        if found is None or found[0]() is not value:
            return None
        return found[1]

    @contextlib.contextmanager
    def recording(self, objects: Iterable[Any]) -> Iterator[None]:
        """Record which attributes of ``objects`` the block reads. Afterwards only these objects
        have names: one not among them (the model dropped it, or it could not be recorded) is
        watched whole until a capture records it.

        A held object the block reads through a recorded one (``self.run.phase.schedule``, at any
        depth) is recorded too, from that first read on; the callback of :meth:`reaching` sees it
        then, before the block can have changed it."""
        on_reach = self._on_reach
        tracked = {id(o): o for o in objects if is_recordable(o)}
        read: dict[int, set[str]] = {i: set() for i in tracked}
        whole: set[int] = set()
        with contextlib.ExitStack() as patches:
            patched: set[type] = set()

            def patch(cls: type) -> None:
                if cls in patched:
                    return
                patched.add(cls)
                recorded = _recording(cls.__getattribute__, tracked, read, whole, reach)
                try:
                    patches.enter_context(mock.patch.object(cls, "__getattribute__", recorded))
                except TypeError:  # a class that refuses new attributes: watched whole
                    whole.update(i for i, o in tracked.items() if type(o) is cls)

            def reach(name: str, value: Any) -> None:
                if id(value) in tracked or not is_held_object(value) or not is_recordable(value):
                    return
                if on_reach is not None:  # first: its reads of the object are not the block's
                    on_reach(name, value)
                tracked[id(value)] = value
                read[id(value)] = set()
                patch(type(value))

            for cls in dict.fromkeys(type(o) for o in tracked.values()):
                patch(cls)
            yield
        names: dict[int, tuple[weakref.ref[Any], tuple[str, ...]]] = {}
        for i, obj in tracked.items():
            if i not in whole:
                earlier = self.names(obj) or ()
                names[i] = (weakref.ref(obj), tuple(sorted(read[i].union(earlier))))
        if {i: n for i, (_, n) in names.items()} != {i: n for i, (_, n) in self._names.items()}:
            self.version += 1
        self._names = names


def _recording(
    inherited: Callable[[Any, str], Any],
    tracked: dict[int, Any],
    read: dict[int, set[str]],
    whole: set[int],
    reach: Callable[[str, Any], None],
) -> Callable[[Any, str], Any]:
    """A ``__getattribute__`` that notes the names looked up on the tracked objects, then looks
    them up as ``inherited`` does, and hands each value read to ``reach``."""

    def recorded(self: Any, name: str) -> Any:
        names = read.get(id(self))
        if names is None or tracked.get(id(self)) is not self:
            return inherited(self, name)
        if name in _WHOLE:
            whole.add(id(self))
            return inherited(self, name)
        if name.startswith("__"):
            return inherited(self, name)
        names.add(name)  # before the lookup: a name read while absent is watched too
        value = inherited(self, name)
        reach(name, value)
        return value

    return recorded
