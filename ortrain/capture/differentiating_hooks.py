"""Gradient hooks that differentiate a graph of the forward during the backward.

A deep equilibrium model's implicit backward registers ``z.register_hook(lambda g:
autograd.grad(f0, z0, g, retain_graph=True)[0] + g)``: the hook differentiates a side graph the
forward built. TorchDynamo's graph breaks, where a forward that installs hooks trains
(:mod:`ortrain.capture.autograd_hooks`), put that side graph in one compiled region with the
outputs, whose backward node the outer backward frees before the hook runs ("backward through the
graph a second time", as under ``torch.compile``). Such a model trains in PyTorch, which keeps the
two graphs apart.

The hook never runs while capturing, so it is recognised by its code: a call of
``autograd.grad`` (``torch.autograd.grad``, or a global name bound to it, as after ``from
torch.autograd import grad``) or of ``.backward``, in the hook, in a function it defines, or in a
method it calls on an object it holds (``lambda g: self.implicit(g)``), one level down. A capture
that fails earlier (a solver's ``.item()`` stopping rule) never reaches the hook: then a forward
that registers a hook and defines such a function counts, read from its code.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch

from ortrain.errors import ORTModuleTorchModelException

_DIFFERENTIATE = (torch.autograd.grad, torch.autograd.backward)
_VARIABLE_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


class DifferentiatingHookError(ORTModuleTorchModelException):
    """The forward installs a gradient hook that differentiates a graph of its own forward.

    TorchDynamo's graph breaks fail on it too, as torch.compile does: the hook's side graph shares
    a compiled region's backward node with the outputs, which the outer backward frees before the
    hook differentiates it ("backward through the graph a second time"). PyTorch keeps the two
    graphs apart, so such a model trains there."""

    def __init__(self, hooks: str) -> None:
        super().__init__(
            f"the forward installs a gradient hook that differentiates during the backward ({hooks} "
            "with autograd.grad or backward inside, as a deep equilibrium model's implicit backward "
            "does): neither a captured graph nor TorchDynamo's graph breaks keep the graph such a "
            "hook differentiates, so this model trains in PyTorch"
        )


def differentiates(hook: object) -> bool:
    """Whether a gradient hook differentiates (see the module)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    function = getattr(hook, "__func__", hook)
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    held = {
        name: cell.cell_contents
        for name, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or (), strict=False)
        if _filled(cell)
    }
    if hasattr(hook, "__self__") and code.co_varnames:
        held[code.co_varnames[0]] = hook.__self__  # a bound method's ``self``
    return _code_differentiates(code, getattr(function, "__globals__", {}), held)


def forward_defines_differentiating_hook(root: torch.nn.Module) -> bool:
    """Whether a forward of the model registers a gradient hook and defines a function that
    differentiates (see the module)."""
    for module in {type(m): m for m in root.modules()}.values():
        forward = type(module).forward
        code = getattr(forward, "__code__", None)
        if code is None or not {"register_hook", "register_prehook"} & set(code.co_names):
            continue
        held = {code.co_varnames[0]: module} if code.co_varnames else {}
        nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
        if any(_code_differentiates(inner, forward.__globals__, held) for inner in nested):
            return True
    return False


def _code_differentiates(code: types.CodeType, module_names: dict[str, Any], held: dict[str, Any]) -> bool:
    """Whether ``code``, a function it defines, or a method it calls on a ``held`` object
    (variable name -> object) differentiates."""
    for inner in _code_tree(code):
        if _calls_differentiation(inner, module_names):
            return True
        for variable, attribute in _attributes_read(inner, held.keys()):
            method = getattr(type(held[variable]), attribute, None)
            method_code = getattr(method, "__code__", None)
            if method_code is not None and any(
                _calls_differentiation(c, method.__globals__) for c in _code_tree(method_code)
            ):
                return True
    return False


def _calls_differentiation(code: types.CodeType, module_names: dict[str, Any]) -> bool:
    names = set(code.co_names)
    if "backward" in names or {"autograd", "grad"} <= names:
        return True
    globals_read = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    return any(module_names.get(name) is f for name in globals_read for f in _DIFFERENTIATE)


def _attributes_read(code: types.CodeType, variables: Any) -> Iterator[tuple[str, str]]:
    """(variable, attribute) for each ``variable.attribute`` that ``code`` reads."""
    wanted = set(variables)
    previous = None
    for instruction in dis.get_instructions(code):
        if (
            previous is not None
            and instruction.opname in _ATTRIBUTE_LOADS
            and previous.opname in _VARIABLE_LOADS
            and previous.argval in wanted
        ):
            yield previous.argval, instruction.argval
        previous = instruction


def _code_tree(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the functions and lambdas defined in it, at any depth."""
    pending = [code]
    while pending:
        current = pending.pop()
        yield current
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
