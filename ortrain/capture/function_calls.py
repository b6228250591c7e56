"""Turn each user ``torch.autograd.Function`` call made while capturing into one ``python_op`` node.

Every ``torch.autograd.Function.apply`` call is hooked for the duration of a capture only. A call of a
user Function with tensor arguments is registered (see :mod:`ortrain.capture.python_ops`) and
replaced by the operator; AOTAutograd then differentiates the operator through its registered
formula, so the backward graph gets one ``python_op_grad`` node per call.

Functions that belong to PyTorch itself (AOTAutograd's own runtime Function, for one) are left
alone: they are machinery, not model code. ``torch.utils.checkpoint``'s ``CheckpointFunction`` is
decided by :mod:`ortrain.capture.checkpointing`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.function import Function
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils import _pytree as pytree

from ortrain.capture.apply_hook import hooked_apply, original_apply
from ortrain.capture.lifted_numbers import is_lifted_number
from ortrain.capture.python_ops import (
    FunctionCall,
    UnsupportedFunctionError,
    interception_enabled,
    learn_outputs,
    python_op,
    qualified_name,
    register_call,
)

logger = logging.getLogger("ortrain.capture")

# A hook that may claim a call first: returns a result, or NotImplemented to let it through.
CallHook = Callable[[type[Function], tuple[Any, ...], dict[str, Any]], Any]


def _is_internal(cls: type) -> bool:
    """PyTorch's own Functions, and the capture's (``capture/affine_grids.py``): traced inline,
    never a user's Function made a python op."""
    module = cls.__module__
    return module == "torch" or module.startswith(("torch.", "ortrain.capture."))


def _has_nested_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_nested_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nested_tensor(v) for v in value.values())
    return False


def _why_traced_inline(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why a user Function's call cannot be a python op, or None when it can.

    Under a ``torch.func`` transform (``torch.func.vmap(Fn.apply)`` in the forward), a python op's
    output learning calls ``requires_grad_``, which the transform refused, and the model trained in
    PyTorch (wave 48's review); traced inline, the transform runs the Function's own ``vmap`` or
    ``jvp`` rule. Given a size of the trace (``Fn.apply(h, h.shape[0])`` in a capture with open
    sizes), a python op keeps its non-tensor arguments as the capture saw them, and handed the
    symbol to the Function at every run (wave 48's review: a loss of 2.8e14 where eager's was 41.9
    from the second batch size on, and ``reshape(ctx.shape)`` failed)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "is called under a torch.func transform"
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    if any(isinstance(leaf, symbolic) for leaf in pytree.tree_leaves((args, kwargs))):
        return "is given a size the capture leaves open (h.shape[0], h.shape)"
    return None


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _number_type(tensor: torch.Tensor) -> type | None:
    """The type of the number argument ``tensor`` stands for, or None for a tensor."""
    if not is_lifted_number(tensor):
        return None
    return float if tensor.is_floating_point() else bool if tensor.dtype == torch.bool else int


def apply_as_python_op(cls: type[Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record one call of ``cls`` and emit it as an ``ortrain::python_op`` node."""
    name = qualified_name(cls)
    for position, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor) and _has_nested_tensor(arg):
            raise UnsupportedFunctionError(
                f"{name}: argument {position} holds tensors inside a {type(arg).__name__}; ortrain passes "
                "tensors to an opaque Function only as direct arguments"
            )
    if any(_has_nested_tensor(v) for v in kwargs.values()):
        raise UnsupportedFunctionError(f"{name}: tensors passed as keyword arguments are not supported")
    positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    tensors = [args[i] for i in positions]
    needs_grad = tuple(t.requires_grad for t in tensors)
    call = FunctionCall(
        cls=cls,
        args=tuple(None if i in positions else a for i, a in enumerate(args)),
        kwargs=dict(kwargs),
        tensor_positions=positions,
        needs_grad=needs_grad,
        number_types=tuple(_number_type(t) for t in tensors),
        keep_ctx=torch.is_grad_enabled() and any(needs_grad),
        autocast=tuple(
            (device, torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        ),
    )
    # Learn the outputs by running the forward on the traced tensors without recording it: its
    # code sees the same (functional, fake) tensors the model's code sees, closures included.
    with disable_proxy_modes_tracing(), torch.no_grad():
        learn_outputs(call, tensors)
    call_id = register_call(call)
    _calls_made.append(call_id)
    outputs = list(python_op(tensors, call_id))
    if call.keep_ctx:
        outputs.pop()  # the handle: only the backward uses it
    # A mark_dirty input was updated in place in eager mode and returned as the output: do the same
    # here, functionally, so later reads of the input see the new value and gradients flow through.
    for out_index, in_index in call.dirty.items():
        target = tensors[in_index]
        target.copy_(outputs[out_index])
        outputs[out_index] = target
    produced = iter(outputs)
    results = [next(produced) if kind == "tensor" else None for kind in call.output_kinds]
    logger.debug("python op %d: %s", call_id, name)
    return tuple(results) if call.returns_tuple else results[0]


_calls_made: list[int] = []

# Names of ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS already warned about: once per process each.
_unmatched_names_warned: set[str] = set()


def _warn_of_skipped_names_not_called(unmatched: set[str], called: set[str]) -> None:
    """A skipped name no Function of the capture carries is most likely misspelt: the Function it
    meant still runs as a python op, which the user asked not to happen."""
    for name in sorted(unmatched - _unmatched_names_warned):
        _unmatched_names_warned.add(name)
        logger.warning(
            "ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS names %s, but the model called no Function of that "
            "name while being captured (it called: %s); check the spelling: module path and "
            "__qualname__, as in pkg.layers.Gelu",
            name,
            ", ".join(sorted(called)) or "none",
        )


# Functions of libraries that are plain math, traced inline whatever the options say: DeepSpeed
# ZeRO-3 replaces ``F.linear`` process-wide by a Function whose only difference from a linear is
# gathering a partitioned weight in backward (ORTModule gathers for the whole graph: see
# ortrain/ortmodule/zero3.py); as a python op, every matmul of the model would run in PyTorch.
TRACED_INLINE = frozenset({"deepspeed.runtime.zero.linear.LinearFunctionForZeroStage3"})


# User Functions traced inline while capturing (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0, or skipped by
# name), counted: see inline_function_calls.
_inline_calls = [0]


def inline_function_calls() -> int:
    """How many user ``autograd.Function`` calls captures have traced inline so far: a trace that
    meets one holds the Function's forward as plain operators, and differentiating that forward
    is not the Function's own backward (a straight-through estimator, a gradient reversal)."""
    return _inline_calls[0]


@contextlib.contextmanager
def intercept_functions(
    *, opaque: bool, hook: CallHook | None = None, skipped: frozenset[str] = frozenset()
) -> Iterator[list[int]]:
    """Intercept every ``Function.apply`` call while capturing; yields the call ids registered meanwhile.

    The interception sits below the attribute (see :mod:`ortrain.capture.apply_hook`), so
    ``self.fn = Fn.apply`` bound before the capture, aliases, ``functools.partial`` and subclasses
    are caught like ``Fn.apply``. ``opaque`` turns user Functions into python ops
    (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=1), except those whose fully qualified name is in ``skipped``
    (ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS): they are traced inline. ``hook`` (checkpointing) sees
    every call first, torch's own Functions included.
    """
    first = len(_calls_made)
    # The hook is process-wide, the capture is not: other threads' Functions run as themselves.
    capturing_thread = threading.get_ident()

    called: set[str] = set()

    def apply(cls: type[Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if threading.get_ident() == capturing_thread and interception_enabled():
            name = None if _is_internal(cls) else qualified_name(cls)
            if name is not None:
                called.add(name)
            if hook is not None:
                result = hook(cls, args, kwargs)
                if result is not NotImplemented:
                    return result
            user = name is not None and name not in TRACED_INLINE
            if opaque and user and name not in skipped and _has_nested_tensor(args):
                why = _why_traced_inline(args, kwargs)
                if why is None:
                    return apply_as_python_op(cls, args, kwargs)
                logger.info("%s %s: traced inline", name, why)
            if user:
                _inline_calls[0] += 1
        return original_apply(cls, *args, **kwargs)

    made: list[int] = []
    try:
        with hooked_apply(apply):
            yield made
        if opaque:
            _warn_of_skipped_names_not_called(skipped - called, called)
    finally:
        made.extend(_calls_made[first:])
        del _calls_made[first:]
