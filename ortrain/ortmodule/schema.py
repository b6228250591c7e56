"""Flatten nested inputs and outputs into a list of tensors plus a hashable spec, and back.

Supported containers: tuple, list, dict, named tuples, dataclasses, Hugging Face ``ModelOutput``s
(an ordered dict that is also a dataclass) and types registered as torch pytree nodes (such as
transformers' ``DynamicCache``). Leaves are tensors or constants
(None, bool, int, float, str, torch.dtype, torch.device). Constants are part of the spec, so a new
constant value means a new graph, which is what the traced model would compute anyway.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch

from ortrain.capture.pytree_nodes import flatten_registered, unflatten_registered
from ortrain.ortmodule.fallback import ORTModuleIOError

_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, enum.Enum)

# A spec is a nested tuple whose first item names the node kind.
Spec = tuple[Any, ...]


def _is_model_output(value: object) -> bool:
    # Duck-typed so that transformers stays an optional dependency.
    return type(value).__name__.endswith("Output") and hasattr(value, "to_tuple") and isinstance(value, dict)


def flatten(value: Any) -> tuple[list[torch.Tensor], Spec]:
    tensors: list[torch.Tensor] = []
    spec = _flatten(value, tensors)
    return tensors, spec


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Spec:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor",)
    if isinstance(value, _CONSTANT_TYPES):
        return ("const", type(value), value)
    if _is_model_output(value):
        keys = tuple(value.keys())
        return ("model_output", type(value), keys, tuple(_flatten(value[k], tensors) for k in keys))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(f.name for f in dataclasses.fields(value) if f.init)
        return ("dataclass", type(value), names, tuple(_flatten(getattr(value, n), tensors) for n in names))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return ("namedtuple", type(value), tuple(_flatten(v, tensors) for v in value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, type(value), tuple(_flatten(v, tensors) for v in value))
    if isinstance(value, dict):
        keys = tuple(value.keys())
        for k in keys:
            if not isinstance(k, _CONSTANT_TYPES):
                raise ORTModuleIOError(
                    f"ORTModule supports dict keys of plain types only, not {type(k).__name__}"
                )
        return ("dict", type(value), keys, tuple(_flatten(value[k], tensors) for k in keys))
    registered = flatten_registered(value)
    if registered is not None:
        children, context = registered
        return ("pytree", type(value), context, tuple(_flatten(c, tensors) for c in children))
    raise ORTModuleIOError(
        f"ORTModule cannot pass a value of type {type(value).__qualname__} to or from the model; "
        "use tensors, numbers, strings, None, or tuples, lists, dicts and dataclasses of them"
    )


def unflatten(spec: Spec, tensors: list[Any]) -> Any:
    it = iter(tensors)
    value = _unflatten(spec, it.__next__)
    if next(it, None) is not None:
        raise ValueError("unflatten got more tensors than the spec holds")
    return value


def _unflatten(spec: Spec, take: Callable[[], Any]) -> Any:
    kind = spec[0]
    if kind == "tensor":
        return take()
    if kind == "const":
        return spec[2]
    if kind == "model_output":
        _, cls, keys, children = spec
        return cls(**{k: _unflatten(c, take) for k, c in zip(keys, children, strict=True)})
    if kind == "dataclass":
        _, cls, names, children = spec
        return cls(**{n: _unflatten(c, take) for n, c in zip(names, children, strict=True)})
    if kind == "namedtuple":
        _, cls, children = spec
        return cls(*(_unflatten(c, take) for c in children))
    if kind in ("tuple", "list"):
        _, cls, children = spec
        return cls(_unflatten(c, take) for c in children)
    if kind == "dict":
        _, cls, keys, children = spec
        return cls((k, _unflatten(c, take)) for k, c in zip(keys, children, strict=True))
    if kind == "pytree":
        _, cls, context, children = spec
        return unflatten_registered(cls, context, [_unflatten(c, take) for c in children])
    raise ValueError(f"unknown spec node {kind!r}")


def tensor_signature(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a graph depends on besides sizes: a change here needs a new capture."""
    return (tensor.dtype, tensor.dim(), tensor.device.type, tensor.requires_grad)
