"""Number arguments handed to a captured forward as 0-d tensors, refused where the model formats them.

A number argument that changes between calls becomes a 0-d tensor input of the graph
(:mod:`ortrain.ortmodule.scalars`); a forward that needs a Python number there fails to trace, and
the argument is then baked in, one graph per value. Formatting it did not fail: ``f"block{n}"``
or ``str(n)`` of a traced tensor is the tensor's own text (``FunctionalTensor(...)``), which the
graph then held, so a branch on it (``if f"block{n}" in SPECIAL``) took the path of no value at all
and an output keyed by it came back under that text (wave 45's review: a loss half of eager's,
silently). While capturing, formatting such a tensor fails the capture, and the number is baked in.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

# id -> the tensor standing for a number argument in the trace running now.
_LIFTED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_lifted_number(tensor: torch.Tensor) -> torch.Tensor:
    """Note that ``tensor`` stands for a number argument (see the module); returns it."""
    _LIFTED[id(tensor)] = tensor
    return tensor


# Python's operators on numbers: where eager computes a number from number arguments. (Not
# ``torch.as_tensor(step)``, ``.clone()``, ``.long()``: eager's results there are tensors.)
# (The methods a Tensor's operators dispatch as: ``t + 1`` arrives as ``Tensor.add``.)
_NUMBER_ARITHMETIC = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "add", "sub", "mul", "div", "neg", "pow", "remainder", "abs", "__rsub__", "__rpow__",
        "__floordiv__", "__rfloordiv__", "__rmod__", "__rtruediv__", "__rdiv__", "__and__", "__or__",
        "__xor__", "__lshift__", "__rshift__",
        # Comparisons: a bool in Python (``Fn.apply(h, alpha > 0.3)``: wave 49's review)
        "lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
    )
    if hasattr(torch.Tensor, name)
)  # fmt: skip


def mark_numbers_computed(func: Any, args: Any, kwargs: Any, result: Any) -> None:
    """A 0-d result of Python arithmetic on number arguments alone (``state["steps"] + T``)
    stands for a number too: formatted, it fails the capture, and returned, it is a number."""
    if not _LIFTED or func not in _NUMBER_ARITHMETIC:
        return
    if not isinstance(result, torch.Tensor) or result.dim() != 0:
        return
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if tensors and all(is_lifted_number(t) for t in tensors):
        mark_lifted_number(result)


def is_lifted_number(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` stands for a number argument in the trace (a forward returning the
    number itself gives it back as a number, as eager does)."""
    return _LIFTED.get(id(tensor)) is tensor


def _refuse_text(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if is_lifted_number(tensor):
        raise TypeError(
            "the forward formats a number argument as text (an f-string, str(), %): it needs the "
            "Python number, which each new value captures with"
        )
    return NotImplemented


_TENSOR_HASH = torch.Tensor.__hash__


def _hash_refusing_numbers(tensor: torch.Tensor) -> int:
    if is_lifted_number(tensor):
        raise TypeError(
            "the forward looks a number argument up in a dict or a set (a tensor's hash is its "
            "identity): it needs the Python number, which each new value captures with"
        )
    return _TENSOR_HASH(tensor)


@contextlib.contextmanager
def number_lookups_refused() -> Iterator[None]:
    """While capturing: a number argument used as a dict key or set member (``SCALE.get(stage,
    1.0)``, ``stage in FROZEN``) fails the capture, and the value is baked in. Traced it is a
    tensor, hashed by identity: the lookup missed and the default was baked into the graph for
    every value (loss 0.58 where eager's was 1.60, wave 45's review). A tensor's hash does not pass
    through PyTorch's function overrides, so the class's own is swapped for the capture's time (the
    same answer, ``id``, for every other tensor)."""
    torch.Tensor.__hash__ = _hash_refusing_numbers  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.__hash__ = _TENSOR_HASH  # type: ignore[method-assign]


def _a_new_tensor(convert: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``convert`` (``torch.as_tensor``, ``torch.asarray``) making a tensor of its own of a number
    argument: eager makes a tensor of the number; traced, the conversion hands back the number's
    own tensor, which would come back as a number."""

    def converted(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = convert(data, *args, **kwargs)
        return result.clone() if is_lifted_number(result) else result

    return converted


def _integral(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex())
    return isinstance(value, int)


def _refuse_negative_power(base: Any, exponent: Any) -> Any:
    """Python's ``int ** int`` is an int, but a float where the exponent is negative (``5 ** -1 ==
    0.2``); an int tensor raised to a negative power is 0 in a trace (eager refuses it). Traced
    with a number argument as base or exponent, an exponent that is negative or of unknown sign
    fails the capture, and the value is baked in (wave 47's review: ``h * n ** -1`` gave a loss of
    0 from the second value of ``n`` on, silently)."""
    lifted = any(isinstance(v, torch.Tensor) and is_lifted_number(v) for v in (base, exponent))
    if not lifted or not (_integral(base) and _integral(exponent)):
        return NotImplemented
    if isinstance(exponent, torch.Tensor) or exponent < 0:
        raise TypeError(
            "the forward raises an int number argument to an int power that may be negative (a "
            "float in Python): it needs the Python number, which each new value captures with"
        )
    return NotImplemented


def _power(base: Any, exponent: Any, *args: Any, **kwargs: Any) -> Any:
    return _refuse_negative_power(base, exponent)


def _reflected_power(exponent: Any, base: Any, *args: Any, **kwargs: Any) -> Any:
    return _refuse_negative_power(base, exponent)


OVERRIDES: dict[Callable[..., Any], Callable[..., Any]] = {
    torch.Tensor.pow: _power,
    torch.Tensor.__pow__: _power,
    torch.Tensor.__ipow__: _power,
    torch.pow: _power,
    torch.Tensor.__rpow__: _reflected_power,
    torch.Tensor.__format__: _refuse_text,
    torch.Tensor.__repr__: _refuse_text,
    torch.as_tensor: _a_new_tensor(torch.as_tensor),
    torch.asarray: _a_new_tensor(torch.asarray),
}
