"""The module-level values a model's forward reads (``TEMPERATURE = 0.5``, set by a schedule).

A captured graph bakes in every Python value its forward read. Values kept on the modules, their
classes and their configs are watched by the guards (:mod:`ortrain.ortmodule.guards`); a global of
the model's own file was not, and a script that anneals a module-level temperature trained on the
first value for good (wave 23).

The forward's code is read, not run: starting from the class's ``forward``, every name it uses is
looked up in its module's globals, and followed into the functions and methods it names (helpers of
the same file, ``self._attend(...)``) and into the attributes of modules it imports
(``settings.TEMPERATURE``, ``helpers.act(x)`` and what ``act`` reads). Plain values found there
(numbers, strings, booleans, ``None``, short tuples of them), dicts and sets, and configuration
objects (``args = parser.parse_args()``, a dataclass instance; until wave 26 a change to
``args.scale`` or ``CONFIG["scale"]`` between steps went unseen) are what the guards read at every
step; so are such values in the closures of the functions walked (a model class defined inside a
function reads its variables). PyTorch's and the standard library's code is not followed: its
globals are its own constants. This over-approximates (a name used as an attribute elsewhere is
watched too, which costs a lookup) and misses values reached in ways code does not name
(``globals()[key]``, ``getattr(module, name)``).

A method of another module that a forward calls (``self.backbone.features(x)``, a head calling
``self.attn.score(q, k)``) is found through the model: the names a class's code looks up on other
objects (:func:`called_names`) are matched against the methods of every class of the model
(:func:`methods_called_from_outside`); until wave 28 such a method patched in after a capture, or
a global only it read, went unseen.
"""

from __future__ import annotations

import dis
import enum
import functools
import inspect
import site
import sys
import sysconfig
import types
import weakref
from collections.abc import Collection, Iterator, Mapping, MutableMapping
from typing import Any

from ortrain.capture.held_objects import is_held_object
from ortrain.capture.plain_values import NOT_PLAIN, is_config_type, plain_form

# (label, namespace, name): read ``namespace[name]`` at every step, reported as ``label``.
Read = tuple[str, MutableMapping[str, Any], str]
# (label, namespace, name): where the forward finds code it runs (a class's ``forward``, a method
# it calls, a module-level helper), compared by identity: ``nn.Linear.forward = patched`` or
# ``modeling.rotate = faster_rotate`` after a capture changes what the model computes.
CodeRead = tuple[str, Mapping[str, Any], str]


class _Cell(MutableMapping[str, Any]):
    """A closure's cell as a namespace of one name, read and written like a module's globals."""

    def __init__(self, cell: types.CellType, name: str) -> None:
        self._cell, self._name = cell, name

    def __getitem__(self, key: str) -> Any:
        if key != self._name:
            raise KeyError(key)
        try:
            return self._cell.cell_contents
        except ValueError:  # an empty cell: the name is not bound yet
            raise KeyError(key) from None

    def __setitem__(self, key: str, value: Any) -> None:
        if key != self._name:
            raise KeyError(key)
        self._cell.cell_contents = value

    def __delitem__(self, key: str) -> None:
        if key != self._name:
            raise KeyError(key)
        del self._cell.cell_contents

    def __iter__(self) -> Iterator[str]:
        return iter([self._name] if self._name in self else [])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except KeyError:
            return False
        return True


class _ClassAttributes(MutableMapping[str, Any]):
    """A class's attributes as a namespace (``Consts.SCALE``, looked up through its bases), read
    and written like a module's globals."""

    def __init__(self, cls: type) -> None:
        self._cls = cls

    def __getitem__(self, key: str) -> Any:
        # Statically: a property on the class (``Cfg.opts`` building an object at each read) is
        # not run, so what the capture's snapshot puts back is the property itself (wave 44: the
        # value it returned once replaced it on the user's class, eager's numbers too).
        value = inspect.getattr_static(self._cls, key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self._cls, key, value)

    def __delitem__(self, key: str) -> None:
        try:
            delattr(self._cls, key)
        except AttributeError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(dir(self._cls))

    def __len__(self) -> int:
        return len(dir(self._cls))


_LIBRARY_PREFIXES = ("torch", "ortrain", "builtins", "typing")  # top-level package names
_STDLIB = sysconfig.get_paths()["stdlib"]
_FUNCTIONS_AT_MOST = 400  # a bound on the walk: Hugging Face's forwards call a few dozen
# (values, code, names looked up on other objects)
_Reads = tuple[tuple[Read, ...], tuple[CodeRead, ...], frozenset[str]]
# class -> (the code each of its code reads found when walked, its reads)
_cache: weakref.WeakKeyDictionary[type, tuple[tuple[Any, ...], _Reads]] = weakref.WeakKeyDictionary()
# class -> (values, code) of its methods that the model's other classes call
_Called = dict[type, tuple[tuple[Read, ...], tuple[CodeRead, ...]]]
# the model's classes -> (each class's called names walked, the code found, the reads found)
_called_cache: dict[
    frozenset[type], tuple[dict[type, frozenset[str]], dict[type, tuple[Any, ...]], _Called]
] = {}
_CALLED_CACHE_AT_MOST = 64
# function -> (the code each of its code reads found when walked, (values, code))
_FunctionReads = tuple[tuple[Read, ...], tuple[CodeRead, ...]]
_function_cache: weakref.WeakKeyDictionary[types.FunctionType, tuple[tuple[Any, ...], _FunctionReads]] = (
    weakref.WeakKeyDictionary()
)


def is_watched(value: Any) -> bool:
    """Plain values, the tables holding them (``CONFIG = {"scale": 2.0}``), configuration objects
    (``args = parser.parse_args()``, a dataclass instance) and other objects of the user's
    (``SCHEDULE = KLSchedule()``, wave 30): what the guards compare."""
    return (
        plain_form(value) is not NOT_PLAIN
        or isinstance(value, enum.Enum)  # ``MODE = Mode.NEG`` (unwatched until wave 44)
        or type(value) in (dict, set)
        or is_config_type(type(value))
        or is_held_object(value)
    )


def global_reads(cls: type) -> tuple[Read, ...]:
    """The plain module-level values ``cls.forward`` may read, directly or through code it names."""
    return _reads(cls)[0]


def code_reads(cls: type) -> tuple[CodeRead, ...]:
    """Where ``cls.forward`` and the functions and methods its code names are looked up: each
    class of the MRO up to the one defining a method (a subclass may be given one later), and the
    module globals holding the functions."""
    return _reads(cls)[1]


def class_reads(cls: type) -> tuple[tuple[Read, ...], tuple[CodeRead, ...]]:
    """:func:`global_reads` and :func:`code_reads` at once (the guards read both at every step)."""
    values, code, _ = _reads(cls)
    return values, code


def function_reads(function: types.FunctionType) -> tuple[tuple[Read, ...], tuple[CodeRead, ...]]:
    """What a function kept on a module or an object (``self.act = make_act(cfg)``) reads besides
    its code: the variables of its closure and its module's globals, through the functions it names,
    and where it finds that code. Until wave 33 such a function was watched by identity alone, and
    a value its closure held (``cfg["kind"] = "tanh"``) changed under the graph unseen."""
    cached = _function_cache.get(function)
    if cached is not None and _same_code(cached[1][1], cached[0]):
        return cached[1]
    code: list[CodeRead] = []
    values = tuple(_walk(object, code, (), functions=(function,)))
    reads = (values, _unique(code))
    _function_cache[function] = (_code_now(reads[1]), reads)
    return reads


def called_names(cls: type) -> frozenset[str]:
    """The names ``cls.forward``'s code (and the code it names) looks up on objects other than
    ``self`` and the globals: ``score`` of ``self.attn.score(q, k)``, among ``view`` and the like."""
    return _reads(cls)[2]


def methods_called_from_outside(classes: Collection[type]) -> _Called:
    """For each class of a model (the classes of its modules), the values and code read by its
    methods that the model's code calls by name on other objects (``self.attn.score(q, k)``
    reaches ``Attention.score``), other than ``forward`` (walked with each class) and PyTorch's."""
    key = frozenset(classes)
    cached = _called_cache.get(key)
    if cached is not None:
        names_walked, code_walked, found = cached
        # Still valid while every class's own walk and the code found stand (a patched method
        # reads other globals, a patched forward calls other names).
        if all(_names_walked(cls) is names_walked[cls] for cls in key) and all(
            _same_code(found[cls][1], code_walked[cls]) for cls in found
        ):
            return found
    names_walked = {cls: called_names(cls) for cls in key}
    names = frozenset().union(*names_walked.values())
    found = {}
    for cls in key:
        starts = sorted(name for name in names if _user_method(cls, name))
        if starts:
            code: list[CodeRead] = []
            values = tuple(_walk(cls, code, starts))
            found[cls] = (values, _unique(code))
    if len(_called_cache) >= _CALLED_CACHE_AT_MOST:  # models built and dropped in a loop
        _called_cache.clear()
    _called_cache[key] = (names_walked, {cls: _code_now(code) for cls, (_, code) in found.items()}, found)
    return found


def _names_walked(cls: type) -> frozenset[str] | None:
    """The names of the class's last walk, not checked against its code: the guards and the key
    read each class (:func:`class_reads`, which walks it again where its code changed) first."""
    cached = _cache.get(cls)
    return cached[1][2] if cached is not None else None


def _user_method(cls: type, name: str) -> bool:
    """Whether ``cls`` has a method ``name`` defined outside PyTorch and the standard library."""
    if name == "forward" or name.startswith("__"):
        return False
    for klass in cls.__mro__:
        if name in klass.__dict__:
            function = _function(klass.__dict__[name])
            return function is not None and not _is_library(str(function.__module__), function.__code__)
    return False


def _unique(code: list[CodeRead]) -> tuple[CodeRead, ...]:
    # By label: a class's __dict__ is a new mapping proxy at every access.
    return tuple({label: (label, namespace, name) for label, namespace, name in code}.values())


def _reads(cls: type) -> _Reads:
    cached = _cache.get(cls)
    if cached is not None and _same_code(cached[1][1], cached[0]):
        return cached[1]
    code: list[CodeRead] = []
    names: set[str] = set()
    values = tuple(_walk(cls, code, ("forward",), names))
    reads = (values, _unique(code), frozenset(names))
    _cache[cls] = (_code_now(reads[1]), reads)
    return reads


def _code_now(code: tuple[CodeRead, ...]) -> tuple[Any, ...]:
    return tuple(namespace.get(name) for _, namespace, name in code)


def _same_code(code: tuple[CodeRead, ...], walked: tuple[Any, ...]) -> bool:
    """Whether the code found where the walk found it is still what it walked: a function patched
    in (``Block._attend = ...``) may read other globals, and is walked again."""
    return all(a is b for a, b in zip(_code_now(code), walked, strict=True))


def _method_reads(cls: type, name: str) -> list[CodeRead]:
    """The places ``self.name`` is looked up in, up to the class defining it (none if no class does)."""
    reads: list[CodeRead] = []
    for klass in cls.__mro__:
        reads.append((f"method {klass.__qualname__}.{name}", klass.__dict__, name))
        if name in klass.__dict__:
            return reads
    return []


def _class_code(cls: type, name: str) -> bool:
    """Whether a class of ``cls``'s own (not PyTorch's) holds ``name`` as code other than a Python
    method: a static method over a builtin, a builtin, a partial, a class."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            value = klass.__dict__[name]
            module = sys.modules.get(klass.__module__)
            own = module is not None and not _is_module_library(module)
            return own and (isinstance(value, staticmethod | classmethod) or callable(value))
    return False


def _is_library(module_name: str, code: types.CodeType) -> bool:
    return module_name.split(".")[0] in _LIBRARY_PREFIXES or code.co_filename.startswith(_STDLIB)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # comprehensions, lambdas, nested functions
            yield from _codes(const)


@functools.lru_cache(maxsize=4096)
def _globals_loaded(code: types.CodeType) -> frozenset[str]:
    """The names ``code`` loads as globals. ``co_names`` also holds every attribute name it uses:
    until wave 42 ``self.b`` made a script's global ``b`` (a loop variable) a read of the forward,
    and each of its values captured a graph again."""
    return frozenset(i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))


def _descriptor_target(value: Any) -> Any:
    """What a class attribute runs: a static or class method's function, a property's getter."""
    if isinstance(value, staticmethod | classmethod):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value


def _function(value: Any) -> types.FunctionType | None:
    value = _descriptor_target(value)
    value = inspect.unwrap(value) if callable(value) else value
    return value if isinstance(value, types.FunctionType) else None


def _functions(value: Any) -> list[types.FunctionType]:
    """The Python functions a method runs: each decorator's wrapper (``functools.wraps`` names the
    function it wraps) and the function itself. Until wave 45 only the innermost was walked: a
    wrapper reading ``SCHEDULE["scale"]`` around ``forward`` was never watched, and the graph kept
    the first value."""
    value = _descriptor_target(value)
    found: list[types.FunctionType] = []
    while callable(value) and len(found) < 16:
        if isinstance(value, types.FunctionType):
            found.append(value)
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is None or wrapped is value:
            break
        value = wrapped
    return found


def _walk(
    cls: type,
    code_found: list[CodeRead],
    starts: Collection[str],
    other_names: set[str] | None = None,
    functions: Collection[types.FunctionType] = (),
) -> Iterator[Read]:
    """The values read by the methods ``starts`` of ``cls`` (and by ``functions``) and the code
    they name; the places that code is looked up go to ``code_found``, names it looks up elsewhere
    to ``other_names``."""
    todo: list[types.FunctionType | None] = [
        f for start in starts for f in _functions(inspect.getattr_static(cls, start, None))
    ]
    todo += functions
    for start in starts:  # PyTorch's classes too: their forward is not walked
        code_found += _method_reads(cls, start)
    seen_functions: set[types.CodeType] = set()
    found: set[tuple[int, str]] = set()
    while todo and len(seen_functions) < _FUNCTIONS_AT_MOST:
        function = todo.pop()
        if function is None or function.__code__ in seen_functions:
            continue
        seen_functions.add(function.__code__)
        if _is_library(str(function.__module__), function.__code__):
            continue
        namespace = function.__globals__
        for code in _codes(function.__code__):
            names = code.co_names
            for name in names:
                if name.startswith("__"):
                    continue
                methods = [m for klass in cls.__mro__ for m in _functions(klass.__dict__.get(name))]
                if methods:  # self.name(...) or super().name(...): the class's methods
                    todo += methods
                    code_found += _method_reads(cls, name)
                elif _class_code(cls, name):
                    # ``ACT = staticmethod(torch.tanh)`` or ``ACT = torch.tanh`` on the class, not
                    # Python code to walk, but what ``self.ACT(x)`` runs: by identity (wave 32).
                    code_found += _method_reads(cls, name)
                if name not in namespace:
                    # ``self.scaler.apply(h)``: also a name of PyTorch's (``nn.Module.apply``), which
                    # the model's own class does not define; it may be another object's method.
                    ours = [m for m in methods if not _is_library(str(m.__module__), m.__code__)]
                    if not ours and other_names is not None:
                        other_names.add(name)
                    continue
                if name in _globals_loaded(code):
                    yield from _global_read(namespace, name, names, todo, code_found, found)
        yield from _closure_reads(function, todo, found)


def _global_read(
    namespace: dict[str, Any],
    name: str,
    names: tuple[str, ...],
    todo: list[types.FunctionType | None],
    code_found: list[CodeRead],
    found: set[tuple[int, str]],
) -> Iterator[Read]:
    """What ``namespace[name]`` (a module's global, named by code that also names ``names``) adds
    to the walk: a value to read, code to watch and walk, or an imported module's attributes."""
    value = namespace[name]
    # A module once per set of names looked up in it (code elsewhere names other attributes of the
    # same module); anything else once.
    by_names = isinstance(value, types.ModuleType) or _is_users_class(value)
    seen = (id(namespace), f"{name}\0{hash(names)}" if by_names else name)
    if seen in found:
        return
    found.add(seen)
    label = f"{namespace.get('__name__', '?')}.{name}"
    if is_watched(value):
        yield f"global {label}", namespace, name
    elif _is_users_class(value):
        # ``Consts.SCALE`` (set at start-up from a file), ``Helpers.act(x)``: the class by
        # identity, and its attributes named in the same code, values read and code walked
        # (until wave 44 only the class's identity: a changed ``Consts.SCALE`` kept the graph of
        # the old one, and a warm capture cache loaded it in a later process).
        code_found.append((f"global {label}", namespace, name))
        yield from _class_attribute_reads(value, label, names, todo, code_found, found)
    elif isinstance(value, type | types.BuiltinFunctionType):
        # ``ACT = torch.tanh`` or ``Norm = nn.LayerNorm``: nothing to walk, but what the
        # forward runs, by identity (until wave 32 a replaced one went unseen).
        code_found.append((f"global {label}", namespace, name))
    elif callable(value):
        code_found.append((f"global function {label}", namespace, name))
        if isinstance(value, types.FunctionType):
            todo.append(value)
        else:
            # A callable object: a partial, or Hugging Face's hub kernel wrapper
            # (``apply_rotary_pos_emb`` is an nn.Module instance): walked through what
            # it wraps or its class's forward.
            todo += _functions(value) or _functions(getattr(type(value), "forward", None))
    elif isinstance(value, types.ModuleType) and not _is_module_library(value):
        # ``settings.TEMPERATURE``, ``helpers.act(x)``, ``pkg.sub.SCALE``: the attributes of an
        # imported module named in the same code. Of the user's own modules (not installed ones)
        # each is read as a global of that module, code included (until wave 41 only plain values
        # were: a helper called as ``helpers.act(x)`` was not walked, and a global it read changed
        # under the graph unseen); of an installed package, its plain values only (pytest's
        # assertion rewriting names its helpers' module in every ``assert``, and their state
        # changes at every call).
        module_namespace = vars(value)
        own = _is_users_module(value)
        for attribute in names:
            if attribute not in module_namespace or attribute.startswith("__"):
                continue
            if own:
                yield from _global_read(module_namespace, attribute, names, todo, code_found, found)
            elif is_watched(module_namespace[attribute]) and (id(module_namespace), attribute) not in found:
                found.add((id(module_namespace), attribute))
                yield f"global {value.__name__}.{attribute}", module_namespace, attribute


def _class_attribute_reads(
    cls: type,
    label: str,
    names: tuple[str, ...],
    todo: list[types.FunctionType | None],
    code_found: list[CodeRead],
    found: set[tuple[int, str]],
) -> Iterator[Read]:
    """What the code naming a global class of the user's reads of it: the attributes among
    ``names`` that it holds, values to read and methods to walk."""
    attributes = _ClassAttributes(cls)
    for attribute in names:
        if attribute.startswith("__") or (id(cls), attribute) in found:
            continue
        held = inspect.getattr_static(cls, attribute, _MISSING)
        if held is _MISSING:
            continue
        found.add((id(cls), attribute))
        function = _function(held)
        if function is not None:
            todo.append(function)
            code_found += _method_reads(cls, attribute)
        elif is_watched(held):  # a plain value held by the class (or a base), not a descriptor
            yield f"class attribute {label}.{attribute}", attributes, attribute


_MISSING = object()


def _is_users_class(value: Any) -> bool:
    """A class defined in a module of the user's (not PyTorch's, a library's or the standard
    library's)."""
    return isinstance(value, type) and _defined_by_user(value.__module__)


def _closure_reads(
    function: types.FunctionType, todo: list[types.FunctionType | None], found: set[tuple[int, str]]
) -> Iterator[Read]:
    """The values a function reads from the scopes it was defined in (a model class made inside a
    function, ``scale`` of ``make_model(scale)``; a config dict the enclosing code keeps changing)."""
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        if name == "__class__":  # the cell ``super()`` reads
            continue
        namespace = _Cell(cell, name)
        value = namespace.get(name)
        if isinstance(value, types.FunctionType):
            todo.append(value)
        elif name in namespace and is_watched(value) and (id(cell), name) not in found:
            found.add((id(cell), name))
            yield f"closure variable {function.__qualname__}.{name}", namespace, name


def closure_variables(function: types.FunctionType) -> Iterator[Read]:
    """Every variable of ``function``'s closure, bound or not, as a namespace of one name (what a
    snapshot records and puts back: :mod:`ortrain.ortmodule.callback_state`)."""
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        if name != "__class__":
            yield f"closure variable {function.__qualname__}.{name}", _Cell(cell, name), name


# Where installed packages live (also the installed part of the capture cache's library roots).
INSTALLED_ROOTS = tuple(
    {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    | set(getattr(site, "getsitepackages", list)())
    | {site.getusersitepackages()}  # ``pip install --user``
)


def is_users_function(function: types.FunctionType) -> bool:
    """A function defined in a module of the user's (not an installed package's, PyTorch's or the
    standard library's)."""
    return _defined_by_user(function.__module__)


def _defined_by_user(module_name: str | None) -> bool:
    module = sys.modules.get(module_name or "")
    return module is not None and _is_users_module(module) and not _is_module_library(module)


def _is_users_module(module: types.ModuleType) -> bool:
    """A module of the user's own (a file outside site-packages, or one made at run time)."""
    path = getattr(module, "__file__", None) or ""
    return not path.startswith(INSTALLED_ROOTS)


def _is_module_library(module: types.ModuleType) -> bool:
    name = module.__name__
    path = getattr(module, "__file__", None) or ""
    return (
        name.split(".")[0] in _LIBRARY_PREFIXES or name in sys.stdlib_module_names or path.startswith(_STDLIB)
    )
