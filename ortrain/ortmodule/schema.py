"""Flatten nested inputs and outputs into a list of tensors plus a hashable spec, and back.

Supported containers: tuple, list, dict, named tuples, ``torch.return_types`` structures (what
``torch.min(x, dim)``, ``sort``, ``topk``... return), dataclasses, Hugging Face ``ModelOutput``s
(an ordered dict that is also a dataclass) and types registered as torch pytree nodes (such as
transformers' ``DynamicCache``). Leaves are tensors or constants
(None, bool, int, float, str, torch.dtype, torch.device). Constants are part of the spec, so a new
constant value means a new graph, which is what the traced model would compute anyway.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ortrain.capture import distribution_objects
from ortrain.capture.exact_numbers import ExactBool, ExactFloat
from ortrain.capture.held_objects import is_held_object
from ortrain.capture.huggingface import layered_cache, rebuilt_cache
from ortrain.capture.lifted_numbers import is_lifted_number, mark_lifted_number
from ortrain.capture.plain_values import NAMESPACES, is_other_number, python_attributes
from ortrain.capture.pytree_nodes import NodeContext, flatten_registered, unflatten_registered
from ortrain.capture.subclass_views import made_as
from ortrain.capture.tensor_subclasses import keeps_its_class, overridden_protocols
from ortrain.errors import GeneratorInputError
from ortrain.ortmodule.fallback import ORTModuleIOError

_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, enum.Enum)

_SYMBOLIC_NUMBERS = {torch.SymInt: torch.int64, torch.SymFloat: torch.float64, torch.SymBool: torch.bool}
_PLAIN_NUMBER = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}

# A spec is a nested tuple whose first item names the node kind.
Spec = tuple[Any, ...]


def _is_model_output(value: object) -> bool:
    # Duck-typed so that transformers stays an optional dependency. Any ``ModelOutput`` (a dict
    # and a dataclass: ``CausalLMOutputWithCrossAttentions`` too), rebuilt by its ``__init__``,
    # which keeps its dict and its fields in step (its ``__post_init__`` sets what it is given).
    return hasattr(value, "to_tuple") and isinstance(value, dict) and dataclasses.is_dataclass(value)


def flatten(value: Any, what: str = "value") -> tuple[list[torch.Tensor], Spec]:
    """Tensors of ``value`` in order, and its spec; ``what`` names it in errors ("output", say)."""
    tensors: list[torch.Tensor] = []
    spec = _flatten(value, tensors, (what, ""))
    return tensors, spec


def flatten_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], Spec]:
    """Flatten a call's arguments; an error names a keyword argument by its name (``input 'batch.mask'``)."""
    tensors: list[torch.Tensor] = []
    try:
        children = (
            ("tuple", tuple, tuple(_flatten(v, tensors, ("input", f"[{i}]")) for i, v in enumerate(args))),
            (
                "dict",
                dict,
                tuple(kwargs),
                tuple(_flatten(v, tensors, ("input", k)) for k, v in kwargs.items()),
            ),
        )
    except RecursionError:
        # A tree whose nodes point back at their parents (a tree-LSTM's input): a RecursionError at
        # every call until wave 45, with no fallback.
        raise ORTModuleIOError(
            "ORTModule cannot pass inputs that refer back to themselves or nest hundreds deep "
            "(objects in a cycle, such as tree nodes with parent links, or a long linked list); pass "
            "the tensors and the structure as flat lists of them"
        ) from None
    return tensors, ("tuple", tuple, children)


def _exact_constant(value: Any) -> Any:
    """``value`` as the spec holds it: floats (NumPy's too) and bools exactly (``-0.0`` is not
    ``0.0``, a NaN is a NaN, ``True`` is not ``1``), other constants as they are."""
    if type(value) is bool:
        return ExactBool(value)
    if isinstance(value, float) or getattr(getattr(value, "dtype", None), "kind", None) == "f":
        return ExactFloat(float(value))
    return value


def _plain_constant(value: Any, kind: type | None = None) -> Any:
    """A constant as the model is given it (its own type: ``np.float32``, ``float``, ``bool``)."""
    if type(value) is ExactBool:
        return bool(value)
    if type(value) is ExactFloat:
        return (kind or float)(float(value))
    return value


def _kept_factory(factory: Any) -> Any:
    """A ``defaultdict``'s factory where the spec can hold it (a class or a builtin: ``list``,
    ``int``); another one (a lambda made per batch, an object) is not kept: a missing key then
    raises KeyError where eager makes a value (a capture per batch, or none, otherwise)."""
    if factory is None or isinstance(factory, type | types.BuiltinFunctionType):
        return factory
    return None


@functools.cache
def _default_dict_of(cls: type, factory: Callable[[], Any] | None) -> Callable[[Any], Any]:
    """``cls`` (a ``defaultdict``) built from pairs with ``factory``; one object per pair, so that
    two calls' specs compare equal."""
    return functools.partial(cls, factory)


def flatten_outputs(value: Any) -> tuple[list[torch.Tensor], Spec]:
    return flatten(value, "output")


def passes_by_attributes(value: object) -> bool:
    """Whether ``value`` goes in and out of a graph by its ``__dict__``: an object of the user's own
    class or a namespace (rebuilt without its ``__init__``)."""
    # ``types.SimpleNamespace(x=..., y=...)`` as a batch, and argparse's namespace.
    by_kind = is_held_object(value) or type(value) in NAMESPACES
    return by_kind and isinstance(getattr(value, "__dict__", None), dict)


def _is_structseq(value: object) -> bool:
    # torch.return_types.* (min, max, sort, topk, ...) are C struct sequences: tuples with field
    # counts but no ``_fields``, rebuilt from one tuple argument.
    return isinstance(value, tuple) and hasattr(type(value), "n_sequence_fields")


def _describe(where: tuple[str, str]) -> str:
    what, path = where
    if not path:
        return f"the {what}" if what in ("input", "output") else what
    return f"{what} {path}" if path.startswith("[") else f"{what} {path!r}"


def _child(where: tuple[str, str], key: Any) -> tuple[str, str]:
    what, path = where
    if isinstance(key, int):
        return (what, f"{path}[{key}]")
    if isinstance(key, str) and key.isidentifier():
        return (what, f"{path}.{key}" if path else key)
    return (what, f"{path}[{key!r}]")


# Tensors no capture can trace: PyTorch's fake tensors have no form of them ("NestedTensorImpl
# doesn't support sizes. Please file an issue", "layout_impl is only implemented for TensorImpl
# subclasses" was the cause the fallback warning gave, sending users to PyTorch's tracker).
_COMPRESSED_SPARSE = frozenset({torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


def _uncapturable(tensor: torch.Tensor) -> str | None:
    if tensor.is_nested:
        return "a nested tensor (torch.nested)"
    if tensor.layout in _COMPRESSED_SPARSE:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    return None


def _plain_input(tensor: torch.Tensor, where: tuple[str, str]) -> torch.Tensor:
    """``tensor`` as the graph takes it: a subclass that overrides nothing as a plain tensor on the
    same memory (``as_subclass`` keeps its autograd history); one that overrides PyTorch's
    operators is refused: the graph would compute what plain tensors do, not what it does."""
    kind = type(tensor)
    if kind is torch.Tensor or kind in (nn.Parameter, nn.Buffer):
        return tensor
    overridden = overridden_protocols(kind)
    if overridden:
        raise ORTModuleIOError(
            f"ORTModule cannot capture {_describe(where)}, a {kind.__qualname__}: a torch.Tensor "
            f"subclass with its own {' and '.join(overridden)}, whose operators a captured graph "
            "would not run; pass tensor.as_subclass(torch.Tensor) if they compute what plain "
            "tensors compute"
        )
    # Until wave 33 such an input (``class Image(torch.Tensor): pass``) failed inside the graph's
    # run and sent the model to PyTorch with an error about ``aten.detach`` dispatch.
    return tensor.as_subclass(torch.Tensor)


def _flatten(value: Any, tensors: list[torch.Tensor], where: tuple[str, str]) -> Spec:
    if isinstance(value, torch.Tensor):
        if (kind := _uncapturable(value)) is not None:
            raise ORTModuleIOError(
                f"ORTModule cannot capture {_describe(where)}, {kind}: pass padded strided tensors "
                "(with a mask) or sparse COO ones (tensor.to_sparse())"
            )
        if where[0] == "input":
            tensors.append(_plain_input(value, where))
            kind: type | None = type(value)
        elif is_lifted_number(value) and not value.is_floating_point():
            # An int argument returned as it was given, or computed from such (``{"step": step}``,
            # ``steps + T``): a number again, as eager returns it (until wave 45 a 0-d tensor from
            # its second value on). A float one stays a 0-d tensor: the graph holds it in float32,
            # and 0.7 would come back 0.699999988 as if it were eager's.
            tensors.append(value)
            return ("symbolic_number", bool if value.dtype == torch.bool else int)
        else:
            tensors.append(value)
            kind = made_as(value)  # returned as ``tensor.as_subclass(kind)`` (capture only)
        # A class whose operators' results take it (``class Image(torch.Tensor): pass``): a plain
        # tensor in the graph, that class again on the way in and out, as eager's results have it.
        return ("tensor", kind) if kind is not None and keeps_its_class(kind) else ("tensor",)
    # A NumPy scalar, a Fraction (``model(x, np.float32(t))``) too: a constant, by value, as
    # eager's code gets it (until wave 36 the model fell back to PyTorch for good).
    if isinstance(value, _CONSTANT_TYPES) or is_other_number(type(value)):
        # Floats and bools held exactly: ``-0.0`` after ``0.0``, ``1`` after ``True``, are other
        # inputs, and a NaN equals a NaN (wave 45's review: ``copysign(1, direction)`` ran the
        # graph of ``0.0`` for ``-0.0``, and a NaN switch captured at every call).
        return ("const", type(value), _exact_constant(value))
    if isinstance(value, tuple(_SYMBOLIC_NUMBERS)):
        # A number computed from a size the graph leaves open (``x.shape[0]`` returned by a model
        # captured for any batch size): the graph returns it as a 0-d tensor, given back as a number.
        tensors.append(torch.scalar_tensor(value, dtype=_SYMBOLIC_NUMBERS[type(value)]))
        return ("symbolic_number", _PLAIN_NUMBER[type(value)])
    if _is_model_output(value):
        keys = tuple(value.keys())
        children = tuple(_flatten(value[k], tensors, _child(where, k)) for k in keys)
        return ("model_output", type(value), keys, children)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # By its attributes, rebuilt without ``__init__``: a ``__post_init__`` that normalizes a
        # field ran again on the normalized value, a field with ``init=False`` set after building
        # (``b.weight = 10``) came back None, a custom ``__init__`` refused the fields (wave 45).
        # Its fields that are set (in slots or not), then its other attributes that are data (a
        # function ``__post_init__`` keeps is left out, as before).
        names = [f.name for f in dataclasses.fields(value) if hasattr(value, f.name)]
        children = [_flatten(getattr(value, n), tensors, _child(where, n)) for n in names]
        for name, attribute in getattr(value, "__dict__", {}).items():
            if name in names:
                continue
            before = len(tensors)
            try:
                children.append(_flatten(attribute, tensors, _child(where, name)))
            except ORTModuleIOError:
                del tensors[before:]
                continue
            names.append(name)
        return ("dataclass", type(value), tuple(names), tuple(children))
    if _is_structseq(value):
        return (
            "structseq",
            type(value),
            tuple(_flatten(v, tensors, _child(where, i)) for i, v in enumerate(value)),
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        children = tuple(
            _flatten(v, tensors, _child(where, n)) for n, v in zip(value._fields, value, strict=True)
        )
        return ("namedtuple", type(value), children)
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return (kind, type(value), tuple(_flatten(v, tensors, _child(where, i)) for i, v in enumerate(value)))
    if isinstance(value, dict):
        keys = tuple(value.keys())
        for k in keys:
            if not isinstance(k, _CONSTANT_TYPES):
                raise ORTModuleIOError(
                    f"ORTModule supports dict keys of plain types only, not {type(k).__name__} "
                    f"(in {_describe(where)})"
                )
        kind = type(value)
        if isinstance(value, collections.defaultdict):  # ``cls(pairs)`` took the pairs as its factory
            kind = _default_dict_of(kind, _kept_factory(value.default_factory))
        children = tuple(_flatten(value[k], tensors, _child(where, k)) for k in keys)
        # Keys held exactly: ``{True: t}`` after ``{1: t}``, ``{-0.0: t}`` after ``{0.0: t}`` ran the
        # first one's graph (wave 45's review).
        return ("dict", kind, tuple(_exact_constant(k) for k in keys), children)
    layered = layered_cache(value)
    if layered is not None:
        attributes, layers = layered
        layer_specs = tuple(
            (
                layer_type,
                tuple(state),
                tuple(_flatten(v, tensors, _child(where, k)) for k, v in state.items()),
            )
            for layer_type, state in layers
        )
        return ("layered_cache", type(value), NodeContext(attributes), layer_specs)
    registered = flatten_registered(value)
    if registered is not None:
        children, context = registered
        flat = tuple(_flatten(c, tensors, _child(where, i)) for i, c in enumerate(children))
        return ("pytree", type(value), context, flat)
    if distribution_objects.is_distribution_object(value):
        # ``return Normal(mu, std)``: by its parameters (ortrain.capture.distribution_objects).
        state = distribution_objects.attributes(value)
        children = tuple(_flatten(v, tensors, _child(where, n)) for n, v in state.items())
        return ("distribution", type(value), tuple(state), children)
    if passes_by_attributes(value):
        # An object of the user's class (``model(batch)`` with ``class Batch``) or a namespace: by
        # its attributes, as a dataclass (until wave 32 the model fell back to PyTorch for good).
        names = tuple(vars(value))
        children = tuple(_flatten(vars(value)[n], tensors, _child(where, n)) for n in names)
        return ("object", type(value), names, children)
    if isinstance(value, torch.Generator) and where[0] == "input":
        # A diffusion model's ``forward(x, generator=g)``: a graph cannot draw from a generator it
        # is handed. Until wave 53 such a call sent the model to PyTorch for good (ortmodule.py).
        raise GeneratorInputError(_describe(where))
    raise ORTModuleIOError(
        f"ORTModule cannot pass {_describe(where)} (a {type(value).__qualname__}) to or from the model; "
        "use tensors, numbers, strings, None, or tuples, lists, dicts, dataclasses and objects of them"
    )


class LiftedNumber:
    """Marks the spec ``("tensor", LiftedNumber)`` of a number argument handed over as a 0-d
    tensor (:mod:`ortrain.ortmodule.scalars`, :mod:`ortrain.capture.lifted_numbers`)."""


def unflatten(spec: Spec, tensors: list[Any]) -> Any:
    it = iter(tensors)
    value = _unflatten(spec, it.__next__)
    if next(it, None) is not None:
        raise ValueError("unflatten got more tensors than the spec holds")
    return value


def _unflatten(spec: Spec, take: Callable[[], Any]) -> Any:
    kind = spec[0]
    if kind == "tensor":
        if len(spec) == 1:
            return take()
        if spec[1] is LiftedNumber:
            return mark_lifted_number(take())
        return take().as_subclass(spec[1])
    if kind == "const":
        return _plain_constant(spec[2], spec[1])
    if kind == "symbolic_number":
        return spec[1](take().item())
    if kind == "model_output":
        _, cls, keys, children = spec
        return cls(**{k: _unflatten(c, take) for k, c in zip(keys, children, strict=True)})
    if kind == "dataclass":  # by its attributes, without ``__init__`` (see _flatten)
        _, cls, names, children = spec
        rebuilt = object.__new__(cls)
        for n, c in zip(names, children, strict=True):
            object.__setattr__(rebuilt, n, _unflatten(c, take))
        return rebuilt
    if kind == "object":
        _, cls, names, children = spec
        # Its __init__ may take other arguments: its state is set.
        try:
            rebuilt = object.__new__(cls)
        except TypeError:  # a class of C with its own __new__ (SimpleNamespace)
            rebuilt = cls.__new__(cls)
        vars(rebuilt).update((n, _unflatten(c, take)) for n, c in zip(names, children, strict=True))
        return rebuilt
    if kind == "distribution":
        _, cls, names, children = spec
        state = {n: _unflatten(c, take) for n, c in zip(names, children, strict=True)}
        return distribution_objects.rebuilt(cls, state)
    if kind == "namedtuple":
        _, cls, children = spec
        return cls(*(_unflatten(c, take) for c in children))
    if kind == "structseq":
        _, cls, children = spec
        return cls(tuple(_unflatten(c, take) for c in children))
    if kind in ("tuple", "list"):
        _, cls, children = spec
        return cls(_unflatten(c, take) for c in children)
    if kind == "dict":
        _, cls, keys, children = spec
        return cls((_plain_constant(k), _unflatten(c, take)) for k, c in zip(keys, children, strict=True))
    if kind == "layered_cache":
        _, cls, attributes, layer_specs = spec
        layers = [
            (layer_type, {k: _unflatten(c, take) for k, c in zip(names, children, strict=True)})
            for layer_type, names, children in layer_specs
        ]
        return rebuilt_cache(cls, dict(attributes.value), layers)
    if kind == "pytree":
        _, cls, context, children = spec
        return unflatten_registered(cls, context, [_unflatten(c, take) for c in children])
    raise ValueError(f"unknown spec node {kind!r}")


def tensor_signature(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a graph depends on besides sizes: a change here needs a new capture."""
    signature = (tensor.dtype, tensor.dim(), tensor.device.type, tensor.requires_grad, memory_layout(tensor))
    attributes = python_attributes(tensor)  # a flag set on the input (``x.scale = 2.0``), wave 30
    return (*signature, attributes) if attributes else signature


def memory_layout(tensor: torch.Tensor) -> str:
    """Which memory layout a tensor has, coarsely: a forward may branch on it (``x.is_contiguous()``,
    a channels-last path), and a capture traces the branch its example takes. Until wave 27 a graph
    traced on a contiguous input also ran a transposed one, taking the contiguous branch. Layouts
    are told apart by kind only: code that reads the strides themselves is not guarded."""
    if tensor.layout != torch.strided:
        return str(tensor.layout).removeprefix("torch.")
    if tensor.is_contiguous():
        return "contiguous"
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "strided"
