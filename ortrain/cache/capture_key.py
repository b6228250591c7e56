"""The cache key of a capture, computed before tracing: what a later process must match to run a
stored capture without tracing the model (see ``ortrain.capture.capture_package``).

The export key (``graph_key.py``) is read off the captured graph; this one has to describe,
without tracing, everything that could change what the trace produces. It is deliberately
conservative: anything it cannot describe makes the capture uncacheable (the export cache still
serves), and anything that might matter is in it, so a miss is the usual price of a doubt:

- the model: every submodule's class and the plain values set on its own classes
  (``Net.SCALE = ...`` at start-up) or in the module-level globals its forward's code names
  (``ortrain.capture.global_reads``), the code of its classes' ``forward`` and of the methods
  and module-level functions that code names, its plain and config-like attributes (described
  recursively: a Hugging Face ``config`` object is read attribute by attribute; a function
  attribute by its code, closure and default arguments, a bound method with the object it is
  bound to), every parameter's, buffer's and tensor attribute's name, dtype, device, shape,
  ``requires_grad`` and tying, the training flags, and the code of every hook;
- the code: the bytes of every Python file loaded from outside the standard library and
  site-packages (the training script, the user's own packages, editable installs), the name and
  version of every installed distribution (for the code in site-packages), and ortrain's own
  sources;
- how the program was started: ``sys.argv`` and the environment (minus variables that a shell
  or a scheduler sets per session; see ``options.environment_for_cache_key``);
- the call: input structure and constants, each input's dtype, shape, device (with its index) and
  ``requires_grad``, which sizes are dynamic, grad mode, autocast, and the global switches that
  change a trace (default dtype, deterministic algorithms, float32 matmul precision, the fast path
  of ``torch.backends.mha``, and the rank, world size and backend of ``torch.distributed``'s
  default process group);
- every ``ORTMODULE_*`` option, and the versions of Python, torch, onnx, onnxscript, onnxruntime
  and ortrain.

Not covered, so not to be relied upon: Python state that no file, argument, environment variable
or module attribute determines (state inside objects the forward reads that the model does not
hold, a random choice made in Python while tracing). ``ORTMODULE_CACHE_CAPTURE=0`` keeps the
export cache and traces every start.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

import ortrain
from ortrain.cache.graph_key import ortrain_code_hash, tensor_digest, versions
from ortrain.cache.torch_namespaces import REMOVED, original_place, replaced_entries
from ortrain.capture.global_reads import (
    INSTALLED_ROOTS,
    CodeRead,
    Read,
    class_reads,
    function_reads,
    is_users_function,
    methods_called_from_outside,
)
from ortrain.capture.held_objects import is_held_object
from ortrain.capture.plain_values import (
    NOT_PLAIN,
    is_config_type,
    is_other_number,
    plain_form,
    python_attributes,
)
from ortrain.capture.tensor_attributes import tensor_attributes

logger = logging.getLogger("ortrain.cache")

_PLAIN = (bool, int, float, str, bytes, type(None))
# Attributes that differ between processes and never change a forward: Hugging Face's
# GenerationConfig keeps hash(self), which Python's hash randomization makes new in every process.
_VOLATILE_ATTRIBUTES = frozenset({"_original_object_hash"})
# nn.Module's own bookkeeping; hooks are described apart, tensors as tensors.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_DEPTH = 6  # config objects nest; deeper than this is not described (and makes the key unusable)
_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
_BUILTINS = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
)


class Undescribable(ValueError):
    """Something the key cannot describe faithfully: the capture is not cached."""


def _code_digest(code: types.CodeType) -> str:
    digest = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        digest.update(
            _code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode()
        )
    digest.update(repr(code.co_names).encode())
    return digest.hexdigest()


def _describe_callable(fn: Any, depth: int = 0) -> Any:
    target = getattr(fn, "__func__", fn)
    if isinstance(target, functools.partial):
        # accelerate patches ``module.forward = partial(new_forward, module)``: a module bound in
        # is named, as a method's module is (described where it is in the model), not walked
        # again (that walk reached the same partial, without end: a RecursionError).
        return {
            "partial": _describe_callable(target.func, depth + 1),
            "args": [_describe_bound(a, depth + 1) for a in target.args],
            "kwargs": {k: _describe_bound(v, depth + 1) for k, v in sorted(target.keywords.items())},
        }
    code = getattr(target, "__code__", None)
    if code is None:
        name = getattr(target, "__qualname__", None)
        if name is None:
            raise Undescribable(f"callable {target!r}")
        return {"builtin": f"{getattr(target, '__module__', '')}.{name}"}
    closure = [describe(c.cell_contents, depth + 1) for c in (target.__closure__ or ())]
    described = {
        "function": f"{target.__module__}.{target.__qualname__}",
        "code": _code_digest(code),
        "closure": closure,
        # ``lambda h, s=cfg["slope"]: ...``: a default is a value the call uses.
        "defaults": describe(target.__defaults__ or (), depth + 1),
        "kwdefaults": describe(dict(sorted((target.__kwdefaults__ or {}).items())), depth + 1),
    }
    if isinstance(target, types.FunctionType):
        # ``self.act = lambda t: t * SLOPE`` with ``SLOPE`` read from a file: the globals it reads
        # and the functions it calls, as the guards watch them (until wave 41 a later process
        # loaded the capture made with the first value).
        described["reads"] = _described_reads(*function_reads(target), depth + 1)
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, types.MethodType) and owner is not None:
        # ``Scaler(s).apply``: the object it is bound to is state the call reads.
        described["self"] = _describe_bound(owner, depth + 1)
    return described


def _describe_bound(value: Any, depth: int) -> Any:
    """A value a method or partial is bound to. A module's own method reads the module, which the
    key describes where the module is in the model."""
    if isinstance(value, nn.Module):
        return ["module", f"{type(value).__module__}.{type(value).__qualname__}"]
    return describe(value, depth)


def _plain_or_kind(value: Any) -> Any:
    """A default or a closure value: by value where plain, else by its code or its type. (Not
    walked: a decorator's closure holds the function it wraps, which may reach itself.)"""
    form = plain_form(value)
    if form is not NOT_PLAIN:
        return form
    code = getattr(value, "__code__", None)
    if code is not None:
        return {"code": _code_digest(code)}
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _values_of(function: Any) -> dict[str, Any]:
    """The values a function's call uses besides its arguments: defaults and closure cells."""
    cells = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            cells.append(_plain_or_kind(cell.cell_contents))
        except ValueError:  # a cell not filled yet
            cells.append(None)
    return {
        "defaults": [_plain_or_kind(v) for v in getattr(function, "__defaults__", None) or ()],
        "kwdefaults": {
            k: _plain_or_kind(v) for k, v in sorted((getattr(function, "__kwdefaults__", None) or {}).items())
        },
        "closure": cells,
    }


def _methods(cls: type, depth: int = 0) -> dict[str, Any]:
    """The methods of an object's classes with their defaults (``def apply(self, h,
    s=CFG["s"])`` on a held object: wave 42's review found a later process loading the capture
    made with another ``s``), and, for the user's own, the globals they read (``return h * S``
    with ``S`` read from a file at start-up: until wave 45 a later process with another ``S``
    loaded the capture made with the first). Every method, called or not: which ones the forward
    reaches (``__call__``, ``forward``, through a list or another held object) is not known here,
    and keying fewer loaded stale captures (wave 45's second look); a per-process value read by a
    method the forward never calls (a start time) makes every process miss, slower and right."""
    found: dict[str, Any] = {}
    for klass in cls.__mro__[:-1]:  # not ``object``
        for name, value in vars(klass).items():
            if isinstance(value, (types.FunctionType, staticmethod, classmethod)) and name not in found:
                found[name] = _describe_code(value)
                function = getattr(value, "__func__", value)
                if isinstance(function, types.FunctionType) and is_users_function(function):
                    reads = _described_reads(*function_reads(function), depth + 1)
                    found[name] = {"method": found[name], "reads": reads}
    return dict(sorted(found.items()))


def _describe_code(function: Any) -> Any:
    """A method or function by its name and code (None where the class does not define the name),
    with the defaults and closure values of it and of each decorator wrapping it (wave 42: a
    method's ``slope=CFG["slope"]`` and ``@scaled(CFG["s"])`` read from a file, changed between
    processes, loaded the capture made with the old value); the globals and attributes its code
    reads are keyed apart (above)."""
    if isinstance(function, property):
        return {"property": [_describe_code(f) for f in (function.fget, function.fset, function.fdel)]}
    outer = getattr(function, "__func__", function) if function is not None else None
    chain = []
    while outer is not None and len(chain) < 16:
        chain.append(outer)
        outer = getattr(outer, "__wrapped__", None)
    target = chain[-1] if chain else None
    code = getattr(target, "__code__", None)
    if isinstance(target, functools.partial):
        # ``ACT = partial(F.leaky_relu, negative_slope=CFG["slope"])``: its function and the
        # values bound in (until wave 44 by its class alone: a slope read from a file, changed
        # between processes, loaded the capture made with the old one).
        return _describe_callable(target)
    if code is None:  # None, a builtin, or a callable object (described by its class)
        if target is None:
            return None
        if isinstance(target, _BUILTINS):
            described = _builtin_name(target)
        else:
            kind = target if isinstance(target, type) else type(target)
            described = f"{kind.__module__}.{kind.__qualname__}"
        if len(chain) == 1:
            return described
        # ``functools.wraps(torch.relu)(lambda x: ...)``: the wrappers' code is what runs.
        return {
            "wraps": described,
            "values": [_values_of(f) for f in chain[:-1]],
            "wrappers": [_code_digest(f.__code__) for f in chain[:-1] if hasattr(f, "__code__")],
        }
    return {
        "function": f"{target.__module__}.{target.__qualname__}",
        "code": _code_digest(code),
        "values": [_values_of(f) for f in chain],
        "wrappers": [_code_digest(f.__code__) for f in chain[:-1] if hasattr(f, "__code__")],
    }


def _builtin_name(value: Any) -> str:
    """C code by its qualified name; a method descriptor (``TensorBase.abs``) names its class's
    module, not its own."""
    owner = getattr(value, "__objclass__", None)
    module = getattr(value, "__module__", None) or getattr(owner, "__module__", "")
    return f"{module}.{value.__qualname__}"


def _is_code(value: Any) -> bool:
    """A method, descriptor or class on a class: code, keyed as code where a forward runs it."""
    return (
        isinstance(value, (type, staticmethod, classmethod, property, functools.partial, *_CALLABLES))
        or inspect.ismethoddescriptor(value)
        or inspect.isdatadescriptor(value)
    )


def _is_class_state(value: Any) -> bool:
    """What the guards watch on a class (``ortrain.ortmodule.guards``): plain values, containers,
    configuration objects and objects of the user's. A logger or a lock on the class is neither, and
    would make every such model uncacheable (wave 41's review)."""
    if _is_code(value):
        return False
    return (
        isinstance(value, (*_PLAIN, tuple, list, dict, set, frozenset))
        or is_other_number(type(value))
        or is_config_type(type(value))
        or is_held_object(value)
    )


def _class_attributes(cls: type, depth: int = 0) -> dict[str, Any]:
    """The values set on a module's or a held object's own classes (``Net.SCALE = cfg["scale"]``
    at start-up, ``Net.CFG = SimpleNamespace(...)``): the forward reads them as it reads the
    object's attributes. Until wave 41 only plain values and containers were keyed: a config
    object on the class read from a file kept its first value's capture. PyTorch's classes hold
    constants of its code, which the versions in the key cover."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        module = klass.__module__
        if module.startswith(("torch.", "builtins")) or module.split(".")[0] in sys.stdlib_module_names:
            continue
        for name, value in vars(klass).items():
            # ``_abc_impl``: the ABC machinery's registry of every ``abc.ABC`` subclass.
            if not name.startswith("__") and name != "_abc_impl" and _is_class_state(value):
                found[name] = value
    return {name: describe(value, depth + 1) for name, value in sorted(found.items())}


def describe(value: Any, depth: int = 0) -> Any:
    """A JSON-able description of a Python value, or :class:`Undescribable`."""
    if depth > _DEPTH:
        raise Undescribable("an attribute nested too deep")
    if isinstance(value, _PLAIN):
        return [type(value).__name__, value if not isinstance(value, bytes) else value.hex()]
    if is_other_number(type(value)):  # a NumPy scalar, a Fraction: by its type and repr
        return list(plain_form(value))
    if isinstance(value, enum.Enum):
        return ["enum", f"{type(value).__module__}.{type(value).__qualname__}", repr(value)]
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ["torch", str(value)]
    if isinstance(value, Path):
        return ["path", str(value)]
    if isinstance(value, torch.Tensor):
        # Reached outside the module tree (a list, a dict, a config): the graph holds it as a
        # constant, so its values are keyed too.
        return [
            "tensor",
            str(value.dtype),
            list(value.shape),
            str(value.device),
            value.requires_grad,
            _values(value),
        ]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [describe(v, depth + 1) for v in value]
        if isinstance(value, (set, frozenset)):
            items.sort(key=json.dumps)
        return [type(value).__name__, items]
    if isinstance(value, dict):
        return ["dict", [[describe(k, depth + 1), describe(v, depth + 1)] for k, v in value.items()]]
    if isinstance(value, type):
        return ["type", f"{value.__module__}.{value.__qualname__}"]
    if isinstance(
        value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
    ):
        return ["callable", _describe_callable(value, depth)]
    if isinstance(value, nn.Module):
        # A module held outside the module tree (in a list: a teacher, an EMA copy): its
        # parameters are not the graph's inputs but constants in it, so they are keyed by value.
        return ["module", describe_model(value, depth=depth + 1, by_value=True)]
    if dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
        fields = (
            vars(value)
            if hasattr(value, "__dict__")
            else {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        )
        cls = type(value)
        described = {
            k: describe(v, depth + 1) for k, v in sorted(fields.items()) if k not in _VOLATILE_ATTRIBUTES
        }
        # ``class Cfg: scale = 1.0`` then ``Cfg.scale = ...`` at start-up: read through the instance.
        return [
            "object",
            f"{cls.__module__}.{cls.__qualname__}",
            described,
            _class_attributes(cls, depth),
            _methods(cls, depth),
        ]
    raise Undescribable(f"a {type(value).__module__}.{type(value).__qualname__} attribute")


def _hooks(table: dict[int, Any], with_kwargs: dict[int, Any] | None = None) -> list[Any]:
    # Hook ids are this process's counters: only the hooks' code and order are described.
    return [[describe(hook), hid in (with_kwargs or {})] for hid, hook in table.items()]


def _values(t: torch.Tensor) -> str:
    if t.device.type == "meta" or (type(t) is not torch.Tensor and not isinstance(t, nn.Parameter)):
        raise Undescribable(f"a {type(t).__name__} whose values cannot be read")
    return tensor_digest(t)


def _tensor(seen: dict[int, str], name: str, t: torch.Tensor | None, by_value: bool) -> Any:
    """A parameter's, buffer's or tensor attribute's signature; a tied tensor names its first place."""
    if t is None:
        return [name, None]
    first = seen.setdefault(id(t), name)
    if first != name:
        return [name, "alias", first]
    # The device with its index: a graph holds device constants (rank 1 on cuda:1 must miss rank 0's).
    signature = [name, str(t.dtype), str(t.device), list(t.shape), t.requires_grad]
    if attributes := python_attributes(t):  # ``weight.lr_scale = 2.0``: read by the trace
        signature.append(describe(attributes))
    return [*signature, _values(t)] if by_value else signature


def _described_reads(reads: tuple[Read, ...], code: tuple[CodeRead, ...], depth: int = 0) -> dict[str, Any]:
    """The module-level values some code reads, and the code it runs (see global_reads)."""
    return {
        "globals read": {label: describe(namespace.get(name), depth) for label, namespace, name in reads},
        "code run": {label: _describe_code(namespace.get(name)) for label, namespace, name in code},
    }


def describe_model(root: nn.Module, *, depth: int = 0, by_value: bool = False) -> list[Any]:
    """Every submodule (pre-order, duplicates kept, as the graphs bind them) and the global hooks.

    The model's own tensors are the graph's inputs: their values are not keyed (``by_value`` is
    for modules the graph reaches some other way)."""
    if depth > _DEPTH:
        raise Undescribable("modules nested too deep")
    seen: dict[int, str] = {}
    modules = []
    for name, m in root.named_modules(remove_duplicate=False):
        cls = type(m)
        attributes = {
            k: describe(v, depth + 1)
            for k, v in sorted(m.__dict__.items())
            if k not in _MODULE_INTERNALS and not isinstance(v, torch.Tensor)
        }

        hooks = [
            _hooks(m._forward_hooks, m._forward_hooks_with_kwargs),
            _hooks(m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs),
            _hooks(m._backward_hooks),
            _hooks(m._backward_pre_hooks),
        ]
        modules.append(
            {
                "name": name,
                "class": f"{cls.__module__}.{cls.__qualname__}",
                "class attributes": _class_attributes(cls),
                # "code run": a class or helper patched at start-up (``nn.Linear.forward = ...``
                # under a flag read from a file) runs other code with the same files and arguments.
                **_described_reads(*class_reads(cls)),
                "attributes": attributes,
                "parameters": [_tensor(seen, f"{name}.{n}", p, by_value) for n, p in m._parameters.items()],
                "buffers": [_tensor(seen, f"{name}.{n}", b, by_value) for n, b in m._buffers.items()],
                "tensor attributes": [
                    _tensor(seen, f"{name}.{n}", t, by_value) for n, t in tensor_attributes(m)
                ],
                "hooks": hooks,
            }
        )
    global_hooks = [
        _hooks(table)
        for table in (
            torch_module._global_forward_hooks,
            torch_module._global_forward_pre_hooks,
            torch_module._global_backward_hooks,
            torch_module._global_backward_pre_hooks,
        )
    ]
    # Methods one module's forward calls on another (``self.scorer.score(h)``), patched or not.
    called = {
        f"{cls.__module__}.{cls.__qualname__}": _described_reads(reads, code)
        for cls, (reads, code) in methods_called_from_outside({type(m) for m in root.modules()}).items()
    }
    return [modules, global_hooks, dict(sorted(called.items()))]


@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")} | set(INSTALLED_ROOTS)
    # ortrain's own files are keyed whole (ortrain_code_hash), loaded or not: what it imports
    # lazily differs between a process that exported and one that loaded from the cache.
    paths.add(str(Path(ortrain.__file__).parent))
    # Both spellings: a module's __file__ is mostly already under one of them as written, which
    # saves resolving ~3000 paths (0.1 s) at every capture.
    return tuple({str(Path(p)) for p in paths if p} | {str(Path(p).resolve()) for p in paths if p})


_file_digests: dict[tuple[str, int, int], str] = {}


def files_changed(digests: dict[str, str]) -> list[str]:
    """The files of ``digests`` (path -> SHA-256) whose contents are not those any more, or gone."""
    changed = []
    for path, digest in digests.items():
        try:
            if _file_digest(Path(path)) != digest:
                changed.append(path)
        except OSError:
            changed.append(path)
    return changed


def _file_digest(path: Path) -> str:
    stat = path.stat()
    memo = (str(path), stat.st_mtime_ns, stat.st_size)
    if memo not in _file_digests:
        _file_digests[memo] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _file_digests[memo]


def user_code(model: nn.Module) -> dict[str, str]:
    """SHA-256 of every loaded Python file outside the standard library and site-packages.

    A model class defined where no file holds its code (a notebook cell, ``exec``) cannot be keyed.
    """
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        source = getattr(module, "__file__", None)
        if source is None:
            raise Undescribable(f"{type(m).__qualname__} is defined outside any file ({type(m).__module__})")
    return loaded_user_files()


def loaded_user_files() -> dict[str, str]:
    """SHA-256 of every Python file loaded now from outside the standard library and
    site-packages (see :func:`user_code`), by resolved path."""
    roots = _library_roots()
    digests = {}
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if not source or source.startswith(roots):
            continue
        path = Path(source).resolve()
        if str(path).startswith(roots) or not path.is_file():
            continue
        try:
            digests[str(path)] = _file_digest(path)
        except OSError as error:  # unreadable: the code it holds cannot be keyed
            raise Undescribable(f"{path} ({error.strerror})") from error
    return dict(sorted(digests.items()))


@functools.cache
def installed_distributions() -> tuple[str, ...]:
    """Each installed distribution as its metadata directory's name, which holds its name and
    version (``torch-2.13.0+cpu.dist-info``), with the ``sys.path`` entry it sits in.

    Read from directory listings: parsing every distribution's metadata file, as
    ``importlib.metadata.distributions()`` does, took 70 ms of a warm-cache first step (66
    distributions, a 2-core AMD EPYC). A legacy ``*.egg-info`` named without a version (a
    ``setup.py develop`` checkout) has its version read from its metadata.
    """
    found = set()
    for entry in sys.path:
        folder = entry or "."  # "" is the current directory
        try:
            with os.scandir(folder) as listing:
                names = [e.name for e in listing if e.name.endswith((".dist-info", ".egg-info"))]
        except OSError:  # a zip file, a path that does not exist
            continue
        for name in names:
            if "-" not in name.rpartition(".")[0]:  # "devlib.egg-info": no version in the name
                try:
                    version = importlib.metadata.PathDistribution(Path(folder) / name).version
                except Exception:  # no readable metadata: the name alone
                    version = "?"
                name = f"{name} {version}"
            found.add(f"{entry}: {name}")
    return tuple(sorted(found))


def patched_torch_functions() -> dict[str, Any]:
    """The entries of PyTorch's namespaces that the script replaced (``torch_namespaces``), each
    by what it holds: a patch applied at start-up (depending on a configuration file, say) changes
    what a graph computes, and until wave 42 a later process without it loaded the capture made
    with it (until wave 54 where the patch was a partial, a PyTorch builtin, a callable object or a
    dunder)."""
    found: dict[str, Any] = {}
    for label, value in replaced_entries().items():
        place = original_place(value)
        if value is REMOVED:
            found[label] = "removed"
        elif place is not None:  # ``torch.relu = torch.sigmoid``: by where PyTorch keeps it
            found[label] = ["pytorch's", place]
        elif isinstance(getattr(value, "__func__", value), types.FunctionType):
            found[label] = _describe_code(value)
        elif isinstance(value, _BUILTINS):
            found[label] = ["builtin", _builtin_name(value)]
        else:  # a partial, a callable object, a value
            found[label] = describe(value)
    return found


def global_switches() -> dict[str, Any]:
    return {
        "default dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "mha fast path": torch.backends.mha.get_fastpath_enabled(),
        "process group": process_group(),
    }


def process_group() -> dict[str, Any] | None:
    """This process's rank and world size, where ``torch.distributed`` is initialized: TorchDynamo
    bakes ``dist.get_rank()`` and ``get_world_size()`` into a graph as constants (a contrastive
    loss's ``arange(n) + n * rank`` labels). Wave 46: ranks started by ``mp.spawn``, which sets no
    ``RANK`` variable, shared one key, and rank 1 ran rank 0's stored capture, silently."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return {"rank": dist.get_rank(), "world size": dist.get_world_size(), "backend": str(dist.get_backend())}


def capture_key(
    model: nn.Module,
    call: dict[str, Any],
    *,
    options: Any,
    environment: dict[str, str],
) -> str | None:
    """The key, or None (logged at DEBUG) where something cannot be described."""
    try:
        material = {
            "model": describe_model(model),
            "call": describe(call),
            "options": describe(options),
            "code": user_code(model),
            "distributions": installed_distributions(),
            "ortrain code": ortrain_code_hash(),
            "versions": versions(),
            "argv": list(sys.argv),
            "environment": environment,
            "switches": global_switches(),
            "patched torch": patched_torch_functions(),
        }
    except Undescribable as reason:
        logger.debug("capture not cached: the key cannot describe %s", reason)
        return None
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
