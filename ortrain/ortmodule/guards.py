"""What a captured graph was built for, read off the model at every step, cheaply.

A graph binds the model's parameters and buffers by position and bakes in everything else its
forward read: which submodules exist and their code, each one's ``training`` flag and plain
attributes (``p``, ``eps``, ...), its hooks, each tensor's dtype, device, shape and
``requires_grad``, and which tensors are the same object (tied weights). One walk over the module
tree per step (the same pre-order as ``named_modules(remove_duplicate=False)``) produces both the
tensors to bind and a flat, hashable description of all that: the *state key*. A step whose key
differs from every cached graph's captures again, and :func:`describe_change` says why.

Replacing a parameter by another of the same dtype, device and shape needs no new graph: the
tensors are bound afresh at every step, so the new one is what runs.

Configuration objects are read too: a module attribute holding a Hugging Face config (any
``PretrainedConfig``), a dataclass instance or a ``SimpleNamespace`` is described by its plain
values (and its short lists, plain-valued dicts and nested configs), once per object and walk,
so ``model.config.use_cache = False`` or ``self.cfg.scale = 2.0`` between steps is seen like a
module's own attribute (until wave 18 the graph kept the value it was captured with). So are the
plain values set on the classes of the modules (``Net.SCALE = 3.0``), and a module's own short
dicts and sets of plain values (``self.loss_weights["kl"] = 0.5``), and the module-level plain
values the forward's code names (:mod:`ortrain.capture.global_reads`), and the plain values of
the other objects a module holds, two levels deep (:mod:`ortrain.capture.held_objects`: a schedule,
``self.annealing.beta``; until wave 30 such an object was watched by identity only), and below that
the objects a capture read through them, at any depth (wave 36). Code is
watched by identity wherever a forward may find it: a function, class or enum member on a held
object or config, in a module's short dict or list, a builtin at module or class level (wave 32).
Not watched:
state deeper than that that no capture read, containers deeper or larger than
:data:`~ortrain.capture.plain_values.CONTAINER_DEPTH` and ``CONTAINER_ENTRIES`` (by identity), or
inside objects of PyTorch's or of the standard library; after changing such state, call
``ORTModule.reset_graphs()``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ortrain.capture.attribute_reads import ABSENT, AttributeReads
from ortrain.capture.exact_numbers import exact, exact_plain_form
from ortrain.capture.global_reads import (
    CodeRead,
    Read,
    class_reads,
    function_reads,
    is_users_function,
    methods_called_from_outside,
)
from ortrain.capture.held_objects import DEPTH as HELD_DEPTH
from ortrain.capture.held_objects import attributes as held_attributes
from ortrain.capture.held_objects import class_attribute, is_held_object, is_pytorch_class
from ortrain.capture.module_paths import CAPTURE_HOOK_IDS
from ortrain.capture.plain_values import (
    CONTAINER_DEPTH,
    CONTAINER_ENTRIES,
    OTHER_SEQUENCES,
    has_plain_form,
    is_array_form,
    is_config_type,
    python_attributes,
    short_entries,
)
from ortrain.capture.plain_values import NOT_PLAIN as _NOT_PLAIN
from ortrain.capture.plain_values import PLAIN as _PLAIN
from ortrain.capture.plain_values import SEQUENCES as _SEQUENCES
from ortrain.capture.plain_values import SHORT as _SHORT
from ortrain.capture.tensor_attributes import is_tensor_attribute, tensor_attributes

# A plain value's form, its numbers compared exactly (``3`` is not ``3.0``: exact_numbers).
_plain_form = exact_plain_form


_UNINITIALIZED = frozenset({nn.UninitializedParameter, nn.UninitializedBuffer})
# What DeepSpeed ZeRO-3's hooks keep on the modules they hook (the wrapper among them), besides
# ``ds_*``, some of it new at every step: its state, not the model's.
_DEEPSPEED_HOOK_STATE = frozenset({"pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt"})
# Most of a module's attributes are its own tables (parameters, hooks, ...): their contents are
# watched where they matter (parameters, buffers, submodules, hook ids).
_TABLES = frozenset({dict, OrderedDict, set})
# ``nn.Module``'s own tables (``_parameters``, ``_forward_hooks``, ...), read above for what matters.
_MODULE_TABLES = frozenset(k for k, v in nn.Module().__dict__.items() if type(v) in _TABLES)
# Per tensor: dtype, device, shape, requires_grad; or, for a second name of the same tensor, the
# position of its first name.
TensorKey = tuple[Any, ...]
# Per module: identity and class, plain attributes (``training`` among them; tuples and lists of plain
# values too), hook ids, parameters, buffers, tensor attributes (tensors in ``__dict__`` that are
# neither: captured as inputs, like buffers), and the identity of every other attribute value (a
# function the forward calls, a ``forward`` patched on the instance, a config object).
ModuleKey = tuple[
    tuple[int, type],
    tuple[tuple[str, Any], ...],
    tuple[int, ...],
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[tuple[str, int], ...],
]


@dataclass(frozen=True)
class ModelState:
    """The tensors a graph binds, in walk order, and the key that says what graphs fit them."""

    tensors: list[torch.Tensor]
    key: tuple[Any, ...]
    # Lazy modules (``nn.LazyLinear``, ...) whose parameters their first forward has yet to make.
    uninitialized: bool = False
    # The held objects and configs the key describes by value (what a capture records reads of),
    # where the walk was asked for them.
    described: tuple[Any, ...] = ()


class Identity:
    """An object in a state key, compared by identity: equal only to the same object, alive.

    Until wave 36 keys held ``id(obj)``: an object replaced between steps is freed, and a later
    one may get its id (a schedule assigning ``types.MappingProxyType`` or NumPy values at every
    step reused them within a few steps), and the graph captured for the first ran for the later
    one, silently. The object is held weakly where it can be (a dead one equals nothing), else
    strongly (a dict, a tuple: its id cannot be reused while a key holds it)."""

    __slots__ = ("_id", "_ref", "_weak")

    def __init__(self, value: Any) -> None:
        self._id = id(value)
        try:
            self._ref: Any = weakref.ref(value, functools.partial(_forget, self._id))
            self._weak = True
        except TypeError:
            self._ref, self._weak = value, False

    def value(self) -> Any:
        return self._ref() if self._weak else self._ref

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity) or other._id != self._id:
            return False
        mine = self.value()
        return mine is not None and mine is other.value()

    def __hash__(self) -> int:
        return self._id

    def __repr__(self) -> str:
        return f"<object {type(self.value()).__name__} at {self._id:#x}>"


# The Identity of each live object held weakly (a strong one would keep its object alive), so
# that a step's walk does not make a new one per attribute; dropped when the object dies. A plain
# dict: the walk looks one up per object attribute of every module (a WeakValueDictionary's
# lookup cost GPT-2's guard 10 %).
_identities: dict[int, Identity] = {}


def _forget(object_id: int, _: Any) -> None:
    known = _identities.get(object_id)
    if known is not None and known.value() is None:
        del _identities[object_id]


def identity_of(value: Any) -> Identity:
    """``value``'s :class:`Identity`."""
    known = _identities.get(id(value))
    if known is not None and known._weak and known._ref() is value:
        return known
    made = Identity(value)
    if made._weak:
        _identities[id(value)] = made
    return made


def is_deepspeed_hook_state(name: str) -> bool:
    """An attribute DeepSpeed ZeRO-3's hooks set on a module they hook."""
    return name.startswith("ds_") or name in _DEEPSPEED_HOOK_STATE


def _hook_ids(m: nn.Module) -> tuple[int, ...]:
    hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    if not any(hooks):
        return ()
    return tuple(hid for table in hooks for hid in table)


class _Walk:
    """What one walk over the model shares: each config described once, the attributes captures
    read of each object (``reads``; None: all of them), and, when a capture asks for them
    (``describe``), the objects described by value; the step's walk does not collect them."""

    def __init__(self, reads: AttributeReads | None, describe: bool) -> None:
        self.reads = reads
        self.configs: dict[int, tuple[Any, ...]] = {}
        self.described: dict[int, Any] | None = {} if describe else None
        # The classes of the held objects described: their methods' code and the
        # globals it reads are watched like the modules' (``self.schedule.value()`` reading a
        # module-level ``BASE``: until wave 32 a change to it kept the old graph).
        self.held_classes: dict[type, None] = {}
        # Whether held functions are described with what they read (:func:`_code_state`): not
        # inside an object kept at module or class level (Hugging Face's attention registry of
        # a dozen functions, one of which a forward runs: reading them all cost GPT-2's guard 40 %).
        self.code_states = True
        self.code_nesting = 0  # held functions being described, one inside another's state
        self.visiting: set[int] = set()  # the held objects being described, one inside another
        self.entries_left = 0  # of the container being described (:func:`_container_description`)

    def read_through(self, value: Any) -> bool:
        """Whether a capture read attributes of ``value``: the guards then follow it below the
        depth they walk whole (``self.run.phase.schedule.beta``), along what was read."""
        return self.reads is not None and self.reads.names(value) is not None

    def watched(self, value: Any, attributes: dict[str, Any]) -> Iterable[tuple[str, Any]]:
        """The (name, value) pairs of ``value``'s attributes that a graph may have baked in: those
        the captures read (ABSENT where ``value`` has no such attribute now), or all of them."""
        if self.described is not None:
            self.described[id(value)] = value
        names = self.reads.names(value) if self.reads is not None else None
        if names is None:
            return attributes.items()
        # A name read that the object does not have is its class's (a method, ``SCALE = 2.0`` in
        # the class body): until wave 32 such a value replaced on the class was not seen.
        kind = type(value)
        return [(n, attributes[n] if n in attributes else class_attribute(kind, n, ABSENT)) for n in names]


def read_state(root: nn.Module, reads: AttributeReads | None = None, *, describe: bool = False) -> ModelState:
    """One walk over ``root``'s tree: every parameter and buffer, and the state key.

    ``reads``: the attributes of held objects and configs that the captures read, the only ones
    watched where known (:mod:`ortrain.capture.attribute_reads`); without it, all of them.
    ``describe``: also list the objects the key describes by value (``ModelState.described``).
    """
    tensors: list[torch.Tensor] = []
    first_position: dict[int, int] = {}
    modules: list[ModuleKey] = []
    uninitialized: list[str] = []
    walk = _Walk(reads, describe)
    # and each class of a module's MRO; (class, "globals") for the globals its forward reads
    classes: dict[Any, tuple[tuple[str, Any], ...]] = {}
    module_classes: list[type] = []  # each module class once

    def tensor_key(name: str, tensor: torch.Tensor | None) -> TensorKey:
        if tensor is None:
            return (name, None)
        seen = first_position.get(id(tensor))
        if seen is not None:
            tensors.append(tensor)
            return (name, "alias", seen)
        first_position[id(tensor)] = len(tensors)
        tensors.append(tensor)
        if type(tensor) in _UNINITIALIZED:  # it has no shape yet
            uninitialized.append(name)
            return (name, "uninitialized")
        attributes = python_attributes(tensor)  # ``weight.lr_scale``, read like a module's (wave 30)
        # Its class and layout too (wave 46's review: a tensor attribute replaced by a
        # ``__torch_function__`` subclass, or by a sparse tensor, of the same shape ran the old
        # graph: the subclass's own arithmetic skipped silently, the sparse one failing in it).
        signature = (tensor.dtype, tensor.device, tensor.shape, tensor.requires_grad)
        return (name, *signature, attributes, type(tensor), tensor.layout)

    stack: list[nn.Module] = [root]
    while stack:
        m = stack.pop()
        # An ORTModule inside the model (or the model itself wrapped twice) lists its model's
        # modules in its own place (its named_modules), and a capture traces into them.
        while "_ortrain_module" in m.__dict__:
            m = m.__dict__["_ortrain_module"]
        attributes = m.__dict__
        # One pass over the attributes for the plain values and the tensor attributes (the
        # guard's cost is this walk: ≈ 5 µs a module).
        plain: list[tuple[str, Any]] = []
        tensor_attrs: list[tuple[str, torch.Tensor]] = []
        objects: list[tuple[str, int]] = []
        for k, v in attributes.items():
            kind = type(v)
            # Private values too (``self._skip = True`` between steps; until wave 27 the graph
            # kept the captured branch): a forward reads them like public ones.
            if kind in _PLAIN:
                plain.append((k, exact(v)))
            elif kind in _TABLES or isinstance(v, dict):
                if k not in _MODULE_TABLES:  # the user's own table (``self.weights = {"kl": 0.1}``)
                    objects.append((k, identity_of(v), _container_description(v, walk) or ()))
            elif has_plain_form(kind) and (form := _plain_form(v)) is not _NOT_PLAIN:
                plain.append((k, form))  # a list or deque of plain values, a NumPy array or scalar
            elif (kind in _SEQUENCES or kind in OTHER_SEQUENCES) and (
                described := _container_description(v, walk)
            ):
                # Per-layer settings as a list of dicts (``self.cfg[1]["scale"] = 2.0``, wave 27),
                # of functions, schedules or dataclasses (``self.acts[0] = ...``,
                # ``self.schedules[1].beta = 2.0``; until wave 32 only the list's identity).
                objects.append((k, identity_of(v), described))
            elif is_tensor_attribute(v):
                tensor_attrs.append((k, v))
            elif is_config_type(kind):
                objects.append((k, identity_of(v), _config_values(v, walk)))
            elif is_deepspeed_hook_state(k):
                continue  # DeepSpeed ZeRO-3's hooks set these at every step (functions among them)
            elif kind in _HELD_CODE and (code := _held_code(v, walk)) is not None:
                # A function held by the module (``self.act = make_act(cfg)``): by identity and
                # what it reads (a partial by what it binds: one rebuilt equal keeps the graph).
                objects.append((k, code))
            else:
                # An object of the user's by its values too (``self.schedule.beta``), others by identity.
                held = is_held_object(v)
                objects.append(
                    (k, identity_of(v), _held_values(v, HELD_DEPTH, walk)) if held else (k, identity_of(v))
                )
        params = tuple(tensor_key(n, p) for n, p in _table(m, attributes, "_parameters").items())
        buffers = tuple(tensor_key(n, b) for n, b in _table(m, attributes, "_buffers").items())
        others = tuple(tensor_key(n, t) for n, t in tensor_attrs)
        identity = (id(m), type(m))  # the class too: ``m.__class__ = ...`` swaps its code
        if type(m) not in classes:
            _read_class_values(type(m), classes, walk)
        if (type(m), "globals") not in classes:
            classes[(type(m), "globals")] = _global_values(type(m), walk)
            module_classes.append(type(m))
        submodules = _table(m, attributes, "_modules")
        # Each child under its name, empty slots too: a child moved to another name (``del m.fc;
        # m.proj = fc``, a ModuleDict key renamed) is the same object at the same place in the
        # walk, which a forward reading the name (``hasattr(self, "proj")``, ``for k, head in
        # self.heads.items()``) tells apart (wave 47's review: the old graph ran, silently).
        names = tuple((name, child is None) for name, child in submodules.items())
        modules.append((identity, tuple(plain), _hook_ids(m), params, buffers, others, tuple(objects), names))
        children = [c for c in submodules.values() if c is not None]
        stack.extend(reversed(children))
    for cls, (reads, code) in methods_called_from_outside([*module_classes, *walk.held_classes]).items():
        classes[(cls, "called methods")] = _read_values(reads, code, walk)
    key = (tuple(modules), global_hook_ids(), tuple(classes.items()))
    return ModelState(tensors, key, bool(uninitialized), tuple((walk.described or {}).values()))


def _table(m: nn.Module, attributes: dict[str, Any], name: str) -> Any:
    """A module's ``_parameters``, ``_buffers`` or ``_modules``: in its ``__dict__``, or (a
    ``torch.jit.trace``-d module, whose tables are its script module's: wave 47's review, a
    ``KeyError`` at the first call) through its attribute."""
    table = attributes.get(name)
    return table if table is not None else getattr(m, name)


def _read_class_values(cls: type, classes: dict[Any, tuple[tuple[str, Any], ...]], walk: _Walk) -> None:
    """The plain values set on each class of ``cls``'s MRO not read yet (``Net.SCALE = 2.0``, a
    class-level flag), which the forward reads like the module's attributes. PyTorch's classes hold
    constants of its code. Each class once a walk: Hugging Face's model classes share large bases."""
    for klass in cls.__mro__:
        if klass in classes:
            continue
        if is_pytorch_class(klass):
            classes[klass] = ()
            continue
        values: list[tuple[str, Any]] = []
        for name, value in vars(klass).items():
            if name.startswith("__"):
                continue
            plain = _plain_form(value)
            if plain is not _NOT_PLAIN:
                values.append((f"{klass.__qualname__}.{name}", plain))
            elif type(value) in _TABLES:  # ``LOSS_WEIGHTS = {"kl": 0.1}`` on the class (wave 30)
                values.append((f"{klass.__qualname__}.{name}", _table_values(value)))
            elif is_held_object(value):  # a schedule object shared by the class's instances
                described = _held_description(value, HELD_DEPTH, walk, methods=False)
                values.append((f"{klass.__qualname__}.{name}", described))
            elif is_config_type(type(value)):
                # ``CFG = SimpleNamespace(scale=...)`` or a dataclass instance on the class: by its
                # values (until wave 41 not at all: ``Net.CFG.scale = 0.1`` kept the old graph).
                values.append((f"{klass.__qualname__}.{name}", ("config", _config_values(value, walk))))
        classes[klass] = tuple(values)


def _global_values(cls: type, walk: _Walk) -> tuple[tuple[str, Any], ...]:
    """The module-level values ``cls``'s forward reads (see :mod:`global_reads`), read now, and the
    code it runs: its class's ``forward``, the methods and module-level functions it names, each by
    identity (a function patched in after a capture, ``nn.Linear.forward = ...``, is seen)."""
    return _read_values(*class_reads(cls), walk)


def _read_values(
    reads: tuple[Read, ...], code: tuple[CodeRead, ...], walk: _Walk
) -> tuple[tuple[str, Any], ...]:
    values = [
        (label, _global_value(namespace.get(name, _NOT_PLAIN), walk)) for label, namespace, name in reads
    ]
    values += [(label, _with_defaults(namespace.get(name), walk)) for label, namespace, name in code]
    return tuple(values)


def _with_defaults(value: Any, walk: _Walk) -> _Code:
    """Code by identity, with the default values of the user's own functions: a forward's
    ``temp=1.0`` or ``opts={"scale": 1.0}`` is read at every call, and until wave 44 a changed
    ``Net.forward.__defaults__`` (or the default dict changed in place) kept the captured value.
    Functions of installed packages are by identity alone (a guard read at every step)."""
    function = value.__func__ if isinstance(value, staticmethod | classmethod) else value
    if type(function) is not types.FunctionType or not is_users_function(function):
        return _Code(value)
    defaults = function.__defaults__ or ()
    keywords = function.__kwdefaults__ or {}
    if not defaults and not keywords:
        return _Code(value)
    names = function.__code__.co_varnames[function.__code__.co_argcount - len(defaults) :]
    state = [(f"default {n}", _global_value(d, walk)) for n, d in zip(names, defaults, strict=False)]
    state += [(f"default {n}", _global_value(d, walk)) for n, d in sorted(keywords.items())]
    return _Code(value, tuple(state))


class _Code(tuple[Any]):
    """A function (or None where a class does not define the name) compared by identity, with what
    it computes with besides its code (``state``: a partial's arguments, the values a function of
    the user's reads from its closure and module, as (label, value) pairs); the key holds the
    function itself, so a replaced one's id cannot be reused while the key lives."""

    def __new__(cls, function: Any, state: tuple[Any, ...] = ()) -> _Code:
        return super().__new__(cls, (function, state))

    @property
    def state(self) -> tuple[Any, ...]:
        return self[1]

    def same_function(self, other: _Code) -> bool:
        mine, theirs = self[0], other[0]
        if mine is theirs:
            return True
        if type(mine) is functools.partial and type(theirs) is functools.partial:
            # A partial is what it wraps and binds, where its state says so (one described: the
            # state names at least its function); else it is compared by identity, as any code.
            return bool(self.state) and bool(other.state)
        # ``self.helper.fn = self.scorer.score`` at every step makes a new bound method each time:
        # the same function on the same object is the same code.
        return (
            type(mine) is types.MethodType
            and type(theirs) is types.MethodType
            and mine.__func__ is theirs.__func__
            and mine.__self__ is theirs.__self__
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Code) and self.same_function(other) and self.state == other.state

    def __hash__(self) -> int:
        function = self[0]
        while type(function) is functools.partial:
            function = function.func
        return id(function.__func__) if type(function) is types.MethodType else id(function)

    def __repr__(self) -> str:
        function = self[0]
        # ``torch.tanh``'s __qualname__ is "_VariableFunctionsClass.tanh": its name says more.
        name = "__qualname__" if isinstance(function, types.FunctionType | type) else "__name__"
        return getattr(function, name, None) or repr(function)


def _global_value(value: Any, walk: _Walk) -> Any:
    """A plain value as itself; a table (``CONFIG = {"scale": 2.0}``) by its plain entries and a
    configuration object (``args = parser.parse_args()``) by its values, as on a module."""
    plain = _plain_form(value)
    if plain is not _NOT_PLAIN:
        return plain
    if isinstance(value, enum.Enum):  # one object per member: compared as itself
        return ("member", value)
    kind = type(value)
    if kind in _TABLES:
        if isinstance(value, set) or len(value) > _SHORT:
            return ("table", _table_values(value))
        # Unlike a module's own table, a global one may mix in other objects (a registry of
        # layers next to the scale it applies): its plain entries are what a graph bakes in.
        entries = value.items()
        plain = ((_key_form(k), v) for k, v in entries if type(v) in _PLAIN)
        return ("table", tuple((form, exact(v)) for form, v in plain if form is not _NOT_PLAIN))
    if is_config_type(kind):
        return ("config", _config_values(value, walk))
    if is_held_object(value):  # ``SCHEDULE = KLSchedule()``
        return ("object", _held_description(value, HELD_DEPTH, walk, methods=False))
    return _NOT_PLAIN


def _table_values(table: dict[Any, Any] | set[Any]) -> tuple[Any, ...]:
    """A short dict or set of plain values by its values, a short dict of code
    (``{"act": torch.tanh}``) by the identity of each entry; any other by identity alone."""
    if len(table) > _SHORT:
        return ()
    if isinstance(table, set):
        members = frozenset(map(_key_form, table))
        return () if _NOT_PLAIN in members else (("members", members),)
    values = tuple((_key_form(k), _plain_or_code(v)) for k, v in table.items())
    return () if any(v is _NOT_PLAIN or k is _NOT_PLAIN for k, v in values) else values


def _key_form(key: Any) -> Any:
    """A dict key or set member as the guards compare it: a plain value exactly (``1`` is neither
    ``"1"`` nor ``True``: until wave 52 keys were compared as ``str(key)``), an enum member as
    itself (one object per member: ``self.w[Task.CLS]``), a tuple of those by its items
    (``self.scale[("fc", 0)]``), a frozenset of those by its members, bytes and NumPy scalars by
    type and value; ``_NOT_PLAIN`` for anything else (the container is then watched
    by identity only). Until wave 52 the last two were not plain, and ``self.w[Task.CLS] = 3.0``
    between steps kept the old graph, silently."""
    kind = type(key)
    if kind in _PLAIN:
        return exact(key)
    if kind is bytes:
        return ("bytes", key)
    if isinstance(key, enum.Enum):
        return ("member", key)  # tagged: an IntEnum member equals its int
    if isinstance(key, np.generic) and key.ndim == 0:  # ``np.int64(3)``: its type and value
        return ("numpy", kind, _key_form(key.item()))
    if kind in (tuple, frozenset) and len(key) <= _SHORT:
        items = tuple(_key_form(item) for item in key)
        if any(item is _NOT_PLAIN for item in items):
            return _NOT_PLAIN
        return ("tuple", items) if kind is tuple else ("frozenset", frozenset(items))
    return _NOT_PLAIN


def _show_key(form: Any) -> str:
    """A :func:`_key_form` as the key it stands for, for messages."""
    if type(form) is tuple and len(form) == 2 and form[0] == "member":
        return f"{type(form[1]).__name__}.{form[1].name}"
    if type(form) is tuple and len(form) == 2 and form[0] == "tuple":
        items = [_show_key(item) for item in form[1]]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if type(form) is tuple and len(form) == 2 and form[0] in ("bytes", "frozenset"):
        shown = sorted(_show_key(item) for item in form[1]) if form[0] == "frozenset" else None
        return repr(form[1]) if shown is None else f"frozenset({{{', '.join(shown)}}})"
    if type(form) is tuple and len(form) == 3 and form[0] == "numpy":
        return f"np.{form[1].__name__}({_show_key(form[2])})"
    return repr(form)


def _plain_or_code(value: Any) -> Any:
    """``value``'s plain form, else its code form, else ``_NOT_PLAIN``."""
    plain = _plain_form(value)
    if plain is not _NOT_PLAIN:
        return plain
    code = _code_form(value)
    return _NOT_PLAIN if code is None else code


def _container_description(container: Any, walk: _Walk) -> tuple[tuple[str, Any], ...] | None:
    """:func:`_container_values` of a container held by a module or an object, with its own
    budget of entries (one container's description may describe objects that hold others)."""
    outer = walk.entries_left
    walk.entries_left = CONTAINER_ENTRIES
    try:
        return _container_values(container, walk, CONTAINER_DEPTH)
    finally:
        walk.entries_left = outer


def _container_values(container: Any, walk: _Walk, depth: int) -> tuple[tuple[str, Any], ...] | None:
    """A short dict, list or tuple by its entries, named by key or position: plain values, code
    (by identity), configs and held objects (by their values), and tables and lists of them while
    ``depth`` lasts; a set by its plain members. None where an entry is none of these (a tensor, a
    module) or the container is long, or the walk's budget of entries is spent: it is then watched
    by identity only."""
    if isinstance(container, set):
        return _table_values(container) or None
    entries = short_entries(container)
    if entries is None:
        return None
    values: list[tuple[str, Any]] = []
    by_key = isinstance(container, dict)
    for key, entry in entries:
        walk.entries_left -= 1
        # A dict's keys by their forms (a str as itself), a list's positions as strings.
        name = (key if type(key) is str else _key_form(key)) if by_key else str(key)
        if name is _NOT_PLAIN or walk.entries_left < 0:
            return None
        form = _entry_form(entry, walk, depth)
        if form is _NOT_PLAIN:
            return None
        values.append((name, form))
    return tuple(values)


def _entry_form(entry: Any, walk: _Walk, depth: int) -> Any:
    """How :func:`_container_values` describes one entry, or ``_NOT_PLAIN``."""
    plain = _plain_form(entry)
    if plain is not _NOT_PLAIN:
        return plain
    kind = type(entry)
    if is_config_type(kind):
        return _config_values(entry, walk)
    if is_held_object(entry) and (depth > 1 or walk.read_through(entry)):
        return _held_description(entry, 1, walk)
    if depth > 1 and (kind in _SEQUENCES or kind in OTHER_SEQUENCES or isinstance(entry, dict | set)):
        inner = _container_values(entry, walk, depth - 1)
        return _NOT_PLAIN if inner is None else inner
    code = _held_code(entry, walk)
    return _NOT_PLAIN if code is None else code


def _code_form(value: Any) -> Any:
    """What a graph bakes in by what it is: a function, a class, a callable other than a tensor
    or module (a partial), a property or a class method as a :class:`_Code`, compared by identity;
    an enum member or a dtype as itself (one object per value). None otherwise."""
    if isinstance(value, enum.Enum | torch.dtype):
        return value
    if isinstance(value, property | classmethod) or (
        callable(value) and not isinstance(value, torch.Tensor | nn.Module)
    ):
        return _Code(value)
    return None


def _held_code(value: Any, walk: _Walk) -> Any:
    """:func:`_code_form`, with the state of a function held as a value (on a module, in a
    container, a config or a held object): see :func:`_code_state`."""
    code = _code_form(value)
    # Nested a few deep at most: a partial bound to partials, or one that binds itself.
    if not isinstance(code, _Code) or not walk.code_states or walk.code_nesting >= _CODE_NESTING:
        return code
    walk.code_nesting += 1
    try:
        return _Code(value, _code_state(value, walk))
    finally:
        walk.code_nesting -= 1


def _code_state(value: Any, walk: _Walk) -> tuple[tuple[str, Any], ...]:
    """What a held function computes with besides its code: a partial's function and the
    arguments it binds (its ``keywords`` may be changed in place); the values a function of the
    user's reads from its closure and its module (``make_act(cfg)`` reading ``cfg["kind"]``)."""
    if type(value) is functools.partial:
        state: list[tuple[str, Any]] = [("function", _held_code(value.func, walk))]
        state += [(f"argument {i}", _bound_form(a, walk)) for i, a in enumerate(value.args)]
        state += [(f"keyword {k}", _bound_form(v, walk)) for k, v in value.keywords.items()]
        return tuple(state)
    bound: tuple[tuple[str, Any], ...] = ()
    if type(value) is types.MethodType and is_held_object(value.__self__):
        # ``self.scale = temp.scale``: the method reads its object's attributes (``self.t``, which
        # the loop anneals), and a graph baked them in (wave 50's review: the first value, for good).
        bound = (("object", _held_description(value.__self__, 1, walk)),)
    function = value.__func__ if type(value) is types.MethodType else value
    if type(function) is types.FunctionType:
        return (*bound, *_read_values(*function_reads(function), walk))
    return bound


def _bound_form(argument: Any, walk: _Walk) -> Any:
    """A partial's bound argument as a container entry, or by identity where it is none (a
    tensor, a module): the partial, which the key holds, keeps it alive, so its id stays its own."""
    form = _entry_form(argument, walk, 1)
    return ("object", id(argument)) if form is _NOT_PLAIN else form


def _config_values(config: Any, walk: _Walk) -> tuple[Any, ...]:
    """A config's values: plain ones, short plain lists and dicts, nested configs; others by identity.

    Underscored names too: Hugging Face keeps ``output_attentions`` and the attention
    implementation behind properties, in ``_output_attentions`` and the like.
    """
    done = walk.configs.get(id(config))
    if done is not None:
        return done
    walk.configs[id(config)] = ("cycle",)  # a config that reaches itself again
    attributes = getattr(config, "__dict__", None)
    if attributes is None:  # a dataclass with __slots__
        attributes = {f.name: getattr(config, f.name, None) for f in dataclasses.fields(config)}
    values: list[tuple[str, Any]] = []
    for k, v in walk.watched(config, attributes):
        kind, plain = type(v), _plain_form(v)
        if plain is not _NOT_PLAIN or v is ABSENT:
            values.append((k, v if v is ABSENT else plain))
        elif kind is dict and len(v) <= _SHORT and all(type(i) in _PLAIN for i in v.values()):
            values.append((k, tuple((key, exact(entry)) for key, entry in v.items())))
        elif is_config_type(kind):
            values.append((k, _config_values(v, walk)))
        elif (code := _held_code(v, walk)) is not None:
            values.append((k, code))  # holds the function: a replaced one's id cannot come back
        elif is_held_object(v) and walk.read_through(v):  # ``self.cfg.schedule.beta`` (wave 36)
            values.append((k, _held_description(v, 1, walk)))
        else:
            values.append((k, ("object", identity_of(v))))
    walk.configs[id(config)] = described = tuple(values)
    return described


# Functions held by a module described with their state (other callables: by identity, as before).
_HELD_CODE = frozenset({types.FunctionType, types.MethodType, functools.partial})
_CODE_NESTING = 4

# The first entry of a held object reached through another object, a class or a global: which
# object it is. A forward may compare it by identity (``self.h.mode is Mode.A``) or run its class's
# code, neither of which reads an attribute; a module's own held objects carry their identity in
# the module's entry. Until wave 32 a replaced one whose read values were equal kept the old graph.
_IDENTITY = "<object>"


def _held_description(held: Any, depth: int, walk: _Walk, *, methods: bool = True) -> tuple[Any, ...]:
    """:func:`_held_values` after the object's identity and class (its identity alone where the
    object holds itself, through the objects being described)."""
    identity = (_IDENTITY, (id(held), type(held)))
    if id(held) in walk.visiting:
        return (identity,)
    walk.visiting.add(id(held))
    try:
        return (identity, *_held_values(held, depth, walk, methods=methods))
    finally:
        walk.visiting.discard(id(held))


def _held_values(held: Any, depth: int, walk: _Walk, *, methods: bool = True) -> tuple[Any, ...]:
    """A held object's values, as a config's: plain ones, short plain tables, configs, the held
    objects it holds while ``depth`` lasts, and the code it holds (``self.helper.act = torch.relu``),
    an enum member or a dtype, by identity (until wave 32 left out: the graph kept the function it
    was captured with). Others (tensors, devices) are left out, not watched by identity: an object
    may rebind them at every call (accelerate's hooks set the input's device), and a graph does not
    bake them in."""
    code_states = walk.code_states
    if methods:
        # Not for an object kept at module or class level (Hugging Face's attention registry,
        # ``ALL_ATTENTION_FUNCTIONS``): the methods of such shared registries are the library's,
        # and walking them cost the GPT-2 guard 40 % more.
        walk.held_classes[type(held)] = None
    else:
        walk.code_states = False  # its functions too: by identity
    try:
        return _held_entries(held, depth, walk, methods=methods)
    finally:
        walk.code_states = code_states


def _held_entries(held: Any, depth: int, walk: _Walk, *, methods: bool) -> tuple[Any, ...]:
    values: list[tuple[str, Any]] = []
    for k, v in walk.watched(held, held_attributes(held)):
        kind, plain = type(v), _plain_form(v)
        if plain is not _NOT_PLAIN or v is ABSENT:
            values.append((k, v if v is ABSENT else plain))
        elif kind in _TABLES or isinstance(v, dict) or kind in _SEQUENCES or kind in OTHER_SEQUENCES:
            described = _container_description(v, walk)
            if described is not None:  # others (a list of tensors) are left out, as tensors are
                values.append((k, described))
        elif is_config_type(kind):
            values.append((k, _config_values(v, walk)))
        elif is_held_object(v) and (depth > 1 or walk.read_through(v)):
            # Below the depth walked whole, what a capture read (wave 36: the guards stopped
            # there, and ``self.cfg.aug.level.strength`` changed unseen).
            values.append((k, _held_description(v, max(depth - 1, 1), walk, methods=methods)))
        elif (code := _held_code(v, walk)) is not None:
            values.append((k, code))
    return tuple(values)


def global_hook_ids() -> tuple[int, ...]:
    tables = (
        torch_module._global_forward_hooks,
        torch_module._global_forward_pre_hooks,
        torch_module._global_backward_hooks,
        torch_module._global_backward_pre_hooks,
    )
    if not any(tables):
        return ()
    return tuple(hid for table in tables for hid in table if hid not in CAPTURE_HOOK_IDS)


def tensor_names(root: nn.Module, prefix: str = "") -> list[str]:
    """The name of each tensor :func:`read_state` returns, in the same order."""
    names: list[str] = []
    for module_name, m in root.named_modules(prefix=prefix, remove_duplicate=False):
        dot = f"{module_name}." if module_name else ""
        names += [f"{dot}{n}" for n, p in m._parameters.items() if p is not None]
        names += [f"{dot}{n}" for n, b in m._buffers.items() if b is not None]
        names += [f"{dot}{n}" for n, _ in tensor_attributes(m)]
    return names


def binding_order(root: nn.Module, state_names: list[str], prefix: str) -> list[int]:
    """For each tensor a graph binds (named with ``prefix``), its position in :func:`read_state`'s list."""
    position = {name: i for i, name in reversed(list(enumerate(tensor_names(root, prefix))))}
    missing = [n for n in state_names if n not in position]
    if missing:
        raise RuntimeError(f"the captured graph binds {missing}, which the model does not have")
    return [position[n] for n in state_names]


def without_config_values(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A state key with the values of configs and classes left out (the objects themselves stay):
    what a capture is compared on to tell whether the forward changed only its own configuration."""
    modules, hooks, classes = key
    stripped = tuple((*module[:6], tuple(entry[:2] for entry in module[6])) for module in modules)
    return stripped, hooks, tuple(cls for cls, _ in classes)


def describe_change(
    root: nn.Module, old: tuple[Any, ...], new: tuple[Any, ...], root_name: str = "(the model)"
) -> str:
    """Say, in the model's own names, the first thing that differs between two state keys
    (``root`` named ``root_name``)."""
    old_modules, old_hooks, old_classes = old
    new_modules, new_hooks, new_classes = new
    if old_hooks != new_hooks:
        return "a global module hook was added or removed"
    if old_classes != new_classes and [c for c, _ in old_classes] == [c for c, _ in new_classes]:
        for (_, before), (_, after) in zip(old_classes, new_classes, strict=True):
            if before != after:
                change = _value_change(before, after)
                return change if change.startswith(("global ", "method ")) else f"class attribute {change}"
    named = [(name or root_name, m) for name, m in root.named_modules(remove_duplicate=False)]
    if len(old_modules) != len(new_modules):
        return f"submodules were added or removed ({len(old_modules)} → {len(new_modules)} modules)"
    for (name, module), before, after in zip(named, old_modules, new_modules, strict=True):
        if before == after:
            continue
        if before[0] != after[0]:
            if before[0][0] == after[0][0]:
                return f"the class of submodule {name!r} changed to {after[0][1].__qualname__}"
            return f"submodule {name!r} was replaced"
        if before[1] != after[1]:
            return _attribute_change(name, dict(before[1]), dict(after[1]))
        if before[2] != after[2]:
            return f"hooks of {name!r} were added or removed"
        if before[3] != after[3]:
            return _tensor_change(name, "parameter", before[3], after[3])
        if before[4] != after[4]:
            return _tensor_change(name, "buffer", before[4], after[4])
        if before[5] != after[5]:
            return _tensor_change(name, "tensor attribute", before[5], after[5])
        if before[6] != after[6]:
            return _object_change(name, module, before[6], after[6])
    return "the model changed"


def _object_change(module: str, owner: nn.Module, before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """Which object attribute was replaced, or which value of a config or held object changed."""
    found = _first_difference({entry[0]: entry for entry in before}, {entry[0]: entry for entry in after})
    if found is None:
        return f"an attribute of {module!r} was replaced"
    name, was, now = found
    if isinstance(was, tuple) and isinstance(now, tuple) and was[1] == now[1] and len(was) == len(now) == 3:
        held = owner.__dict__.get(name)
        if isinstance(held, dict | list | tuple | set):
            kind = type(held).__name__
            holder = f"{'an' if kind[0] in 'AEIOUaeiou' else 'a'} {kind}"
        else:
            holder = "a config" if is_config_type(type(held)) else "an object"
        return f"{_joined(name, _value_change(was[2], now[2]))} ({holder} held by {module!r})"
    both = isinstance(was, tuple) and isinstance(now, tuple) and len(was) == len(now) == 2
    if both and (_is_function_entry(was) or _is_function_entry(now)):
        return f"{_value_change((was,), (now,))} (a function held by {module!r})"
    return f"attribute {name!r} of {module!r} was replaced"


def _is_function_entry(entry: Any) -> bool:
    """Whether a module's object entry is a function it holds, ``(name, _Code)``."""
    return isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], _Code)


_SHOWN = (bool, int, float, str, type(None))


def _value_change(before: tuple[tuple[str, Any], ...], after: tuple[tuple[str, Any], ...]) -> str:
    """The first of two (name, value) lists' differences: "scale changed from 1.0 to 3.0"."""
    before_values, after_values = dict(before), dict(after)
    # Replaced code first: the new code may read other values, which is not the news.
    for name in sorted(set(before_values) | set(after_values), key=_name_order):
        was, now = before_values.get(name), after_values.get(name)
        if was != now and (isinstance(was, _Code) or isinstance(now, _Code)):
            if isinstance(was, _Code) and isinstance(now, _Code) and was.same_function(now):
                return f"{name}: {_value_change(was.state, now.state)}"
            return f"{name} was replaced (the forward runs other code)"
    found = _first_difference(before_values, after_values)
    if found is None:
        return "a value changed"
    key, was, now = found
    name = key if type(key) is str else f"[{_show_key(key)}]"  # a dict's key (_container_values)
    shown = (*_PLAIN, enum.Enum, torch.dtype)
    if (isinstance(was, shown) or was is ABSENT) and (isinstance(now, shown) or now is ABSENT):
        return f"{name} changed from {was!r} to {now!r}"
    # A global table or configuration object (_global_value): name the entry that changed.
    kinds = (("table",), ("config",), ("object",))
    tagged = isinstance(was, tuple) and isinstance(now, tuple) and len(was) == len(now) == 2
    # A config's other object is ("object", its id): no entries to name.
    if tagged and was[:1] == now[:1] in kinds and isinstance(was[1], tuple) and isinstance(now[1], tuple):
        before_items, after_items = dict(was[1]), dict(now[1])
        if before_items.get(_IDENTITY) != after_items.get(_IDENTITY):
            return f"{name} was replaced"
        for key in [*before_items, *(k for k in after_items if k not in before_items)]:
            old, new = before_items.get(key, "<unset>"), after_items.get(key, "<unset>")
            if old != new and isinstance(old, _SHOWN) and isinstance(new, _SHOWN):
                entry = f"[{_show_key(key)}]" if was[0] == "table" else f".{key}"
                return f"{name}{entry} changed from {old!r} to {new!r}"
    if _is_described_object(was) and _is_described_object(now):  # a held object's held object
        if dict(was).get(_IDENTITY) != dict(now).get(_IDENTITY):
            return f"{name} was replaced"
        return _joined(name, _value_change(was, now))
    if isinstance(was, tuple) and isinstance(now, tuple):  # a list, an array
        return f"{name} changed from {_show_value(was)} to {_show_value(now)}"
    return f"{name} changed"


def _joined(name: str, change: str) -> str:
    """``name.change``, or ``name[key] ...`` where the change is a dict's other key's."""
    return f"{name}{change}" if change.startswith("[") else f"{name}.{change}"


def _is_described_object(value: Any) -> bool:
    """Whether ``value`` is a (name, value) list: the description of a held object or config."""
    return isinstance(value, tuple) and all(
        isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) for entry in value
    )


def _attribute_change(module: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    found = _first_difference(before, after)
    if found is None:
        return f"attributes of {module!r} changed"
    key, old, new = found
    if key == "training":
        return f"submodule {module!r} was switched to {'train' if new else 'eval'} mode"
    if is_array_form(old) and is_array_form(new) and old[1:3] == new[1:3]:
        return f"{module}.{key} changed in place ({_show_value(new)})"
    return f"{module}.{key} changed from {_show_value(old)} to {_show_value(new)}"


def _show_value(value: Any) -> str:
    """A value for a message, kept short: a NumPy array by its dtype and shape, a long list cut."""
    if is_array_form(value):
        return f"an array ({value[1]}, shape {list(value[2])})"
    if type(value) is tuple and len(value) == 3 and value[0] == "number":
        return value[2]  # a NumPy scalar, a Fraction: its repr
    if type(value) is tuple and len(value) == 2 and value[0] == "list" and type(value[1]) is tuple:
        value = list(value[1])  # a list's plain form: shown as the list
    shown = repr(value)
    return shown if len(shown) <= 80 else f"{shown[:60]}... ({len(value)} entries)"


def _name_order(name: Any) -> tuple[int, str]:
    """Names in sorted order, a dict's other keys (:func:`_key_form`) after them."""
    return (0, name) if type(name) is str else (1, repr(name))


def _first_difference(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first name, in sorted order, whose value differs, with both values ("<unset>" where absent)."""
    for name in sorted(set(before) | set(after), key=_name_order):
        was, now = before.get(name, "<unset>"), after.get(name, "<unset>")
        if was != now:
            return name, was, now
    return None


def _tensor_change(module: str, kind: str, before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    if [t[0] for t in before] != [t[0] for t in after]:
        return f"{kind}s of {module!r} were added or removed"
    fields = ("dtype", "device", "shape", "requires_grad", "Python attributes", "class", "layout")
    for b, a in zip(before, after, strict=True):
        if b == a:
            continue
        name = f"{module}.{b[0]}" if module != "(the model)" else b[0]
        if "alias" in (b[1:2] + a[1:2]) or None in (b[1:2] + a[1:2]):
            return f"{kind} {name!r} was tied, untied or set to None"
        for field_name, x, y in zip(fields, b[1:], a[1:], strict=True):
            if x != y:
                return f"{field_name} of {kind} {name!r} changed from {_show(x)} to {_show(y)}"
    return f"{kind}s of {module!r} changed"


def _show(value: Any) -> str:
    if isinstance(value, torch.Size):
        return str(list(value))
    if isinstance(value, type):
        return value.__qualname__
    return str(value)
