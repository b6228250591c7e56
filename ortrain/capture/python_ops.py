"""The ``ortrain::python_op`` and ``ortrain::python_op_grad`` operators: opaque autograd Functions.

While capturing, each call of a user ``torch.autograd.Function`` becomes one ``python_op`` node in
the forward graph and one ``python_op_grad`` node in the backward graph (see
:mod:`ortrain.capture.function_calls`). The nodes carry only tensors and an integer ``call_id``;
everything else about the call (the Function class object itself, its non-tensor arguments, which
inputs need a gradient) lives in a :class:`FunctionCall` in this module's registry. Keying by the
class object, not by its name, is what keeps two Functions that share a name apart.

``python_op`` returns the Function's outputs plus, when a backward will follow, a zero-size
``int64`` "handle" tensor. At run time the handle carries the real autograd graph (and so the real
``ctx``) from the forward to the backward, riding along with AOTAutograd's saved tensors and
freed with them. The python op executor (:mod:`ortrain.runtime.executors.python_op`) runs them;
this module defines the operators, their shape functions and their autograd formula.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.autograd.function import _is_setup_context_defined

from ortrain.capture.fake_tracing import no_pending_unbacked_symbols
from ortrain.capture.generator_resets import opaque_code

logger = logging.getLogger("ortrain.capture")

NAMESPACE = "ortrain"
LIBRARY = torch.library.Library(NAMESPACE, "DEF")
LIBRARY.define("python_op(Tensor[] inputs, int call_id) -> Tensor[]")
LIBRARY.define(
    "python_op_grad(Tensor handle, Tensor?[] grad_outputs, int call_id, SymInt[] sizes) -> Tensor[]"
)

python_op = torch.ops.ortrain.python_op.default
python_op_grad = torch.ops.ortrain.python_op_grad.default
PYTHON_OPS = frozenset({python_op, python_op_grad})


class UnsupportedFunctionError(RuntimeError):
    """A custom Function cannot run as an opaque Python op; the message names it and says why."""


def qualified_name(cls: type) -> str:
    """Module path plus ``__qualname__``: ``pkg.layers.Gelu``, ``pkg.model.build.<locals>.Gelu``."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class FunctionCall:
    """One traced call of a ``torch.autograd.Function`` and what its run-time kernels need."""

    cls: type[torch.autograd.Function]
    args: tuple[Any, ...]  # the call's arguments, with None where a tensor goes
    kwargs: dict[str, Any]
    tensor_positions: tuple[int, ...]  # argument positions that hold the op's tensor inputs
    needs_grad: tuple[bool, ...]  # per tensor input: requires_grad when traced
    keep_ctx: bool  # a backward follows: keep the autograd graph alive on the handle
    # Filled in by the shape function, which runs the Function's forward on fake tensors:
    output_kinds: list[str] = field(default_factory=list)  # "tensor" or "none", per output
    returns_tuple: bool = True
    non_differentiable: set[int] = field(default_factory=set)  # tensor output indices
    dirty: dict[int, int] = field(default_factory=dict)  # tensor output index -> tensor input index
    grad_dtypes: list[torch.dtype] = field(default_factory=list)  # per input that needs grad
    grad_devices: list[torch.device] = field(default_factory=list)
    grad_ranks: list[int] = field(default_factory=list)
    output_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=list)
    # Tensor inputs that need grad but whose gradient the Function's backward leaves as None.
    none_grads: frozenset[int] = frozenset()
    # (device type, dtype) of the autocast regions enabled where the call was made. The op's kernel
    # runs below the dispatcher's autocast, so its forward would run in full precision where
    # eager's runs in the region's (wave 41: a bf16 region's LSTM returned float32, an RNN's
    # weight gradient 12 % off): it enters them again (:meth:`forward_precision`).
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    # Per tensor input: the Python type of the number argument it stands for (a number that
    # changes between calls reaches the graph as a 0-d tensor, ortrain.ortmodule.scalars), else
    # None. The Function gets the number back at run time, as eager gives it (wave 48's review:
    # ``isinstance(alpha, float)`` took the tensor branch from the number's second value on).
    number_types: tuple[type | None, ...] = ()

    def forward_precision(self) -> contextlib.ExitStack:
        """The autocast regions the call was made in, entered again around the forward."""
        stack = contextlib.ExitStack()
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        return stack

    @property
    def func_name(self) -> str:
        return qualified_name(self.cls)

    def bind(self, tensors: list[torch.Tensor], *, numbers: bool = False) -> list[Any]:
        """The call's arguments around ``tensors``; with ``numbers``, the inputs standing for a
        number argument as that Python number (at run time: the capture's are fake)."""
        args = list(self.args)
        types = self.number_types or (None,) * len(tensors)
        for position, tensor, number in zip(self.tensor_positions, tensors, types, strict=True):
            args[position] = number(tensor.item()) if numbers and number is not None else tensor
        return args

    def needs_input_grad(self) -> tuple[bool, ...]:
        needs = [False] * len(self.args)
        for position, need in zip(self.tensor_positions, self.needs_grad, strict=True):
            needs[position] = need
        return tuple(needs)


_calls: dict[int, FunctionCall] = {}
_ids = itertools.count()
_lock = threading.Lock()


def register_call(call: FunctionCall) -> int:
    with _lock:
        call_id = next(_ids)
        _calls[call_id] = call
    return call_id


def lookup_call(call_id: int) -> FunctionCall:
    try:
        return _calls[call_id]
    except KeyError:
        raise RuntimeError(f"ortrain python op {call_id} belongs to a capture that was released") from None


def release_calls(call_ids: list[int]) -> None:
    """Forget the calls of a capture that is gone (its graphs can no longer run)."""
    with _lock:
        for call_id in call_ids:
            _calls.pop(call_id, None)


class RecordingCtx:
    """A stand-in ``ctx`` for running a Function's forward on fake tensors: it records the marks."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self._ortrain_dirty: tuple[torch.Tensor, ...] = ()
        self._ortrain_non_differentiable: tuple[torch.Tensor, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self._ortrain_saved = tensors

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return getattr(self, "_ortrain_saved", ())

    def save_for_forward(self, *tensors: Any) -> None:
        pass

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        self._ortrain_dirty += tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        self._ortrain_non_differentiable += tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def learn_outputs(call: FunctionCall, inputs: list[torch.Tensor]) -> None:
    """Run the Function's own forward on the traced tensors, without recording it, to learn the
    metadata of its outputs and the marks it puts on ``ctx``; raises naming the Function."""
    try:
        with opaque_code():  # the Function runs as itself at every step: its generator calls too
            _learn_outputs(call, inputs)
    except UnsupportedFunctionError:
        raise
    except Exception as error:
        raise UnsupportedFunctionError(
            f"{call.func_name}: ortrain runs the Function's forward on fake tensors to learn the shapes "
            f"of its outputs, and that failed ({type(error).__name__}: {error}). Set "
            "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 to trace it into the graph instead, or make its forward "
            "shape-only traceable"
        ) from error


def _learn_outputs(call: FunctionCall, inputs: list[torch.Tensor]) -> None:
    # Clones: a forward that updates an input in place (mark_dirty) must not touch the op's inputs.
    needs = call.needs_grad
    clones = [t.detach().clone().requires_grad_(need) for t, need in zip(inputs, needs, strict=True)]
    args = call.bind(clones)
    ctx = RecordingCtx(call.needs_input_grad())
    cls = call.cls
    with no_interception(), call.forward_precision():
        if _is_setup_context_defined(cls.setup_context):
            result = cls.forward(*args, **call.kwargs)
            cls.setup_context(ctx, tuple(args), result)
        else:
            result = cls.forward(ctx, *args, **call.kwargs)
    call.returns_tuple = isinstance(result, tuple)
    outputs = list(result) if call.returns_tuple else [result]
    call.output_kinds = []
    tensors: list[torch.Tensor] = []
    for position, out in enumerate(outputs):
        if out is None:
            call.output_kinds.append("none")
        elif isinstance(out, torch.Tensor):
            call.output_kinds.append("tensor")
            tensors.append(out)
        else:
            raise UnsupportedFunctionError(
                f"{call.func_name}: forward output {position} is a {type(out).__name__}; "
                "ortrain runs Functions whose outputs are tensors or None"
            )
    non_diff = {id(t) for t in ctx._ortrain_non_differentiable}
    call.non_differentiable = {
        i for i, t in enumerate(tensors) if id(t) in non_diff or not (t.is_floating_point() or t.is_complex())
    }
    clone_index = {id(t): i for i, t in enumerate(clones)}
    call.dirty = {}
    for marked in ctx._ortrain_dirty:
        if id(marked) not in clone_index:
            raise UnsupportedFunctionError(
                f"{call.func_name}: mark_dirty was given a tensor that is not an input"
            )
        for i, t in enumerate(tensors):
            if t is marked:
                call.dirty[i] = clone_index[id(marked)]
    grad_inputs = [t for t, need in zip(inputs, call.needs_grad, strict=True) if need]
    call.grad_dtypes = [t.dtype for t in grad_inputs]
    call.grad_devices = [t.device for t in grad_inputs]
    call.grad_ranks = [t.dim() for t in grad_inputs]
    call.output_meta = [(t.shape, t.dtype, t.device) for t in tensors]
    call.none_grads = _grads_left_none(call, ctx, outputs)


def _grads_left_none(call: FunctionCall, ctx: RecordingCtx, outputs: list[Any]) -> frozenset[int]:
    """Run the backward on fake tensors to learn which inputs it gives no gradient.

    Such an input's gradient is then None, as in eager mode, rather than zeros: a parameter reached
    only that way keeps ``.grad is None``, which optimizers treat differently from zeros (no weight
    decay, no momentum). Where the fake run fails, gradients stay zeros, which sum the same.
    """
    if not any(call.needs_grad):
        return frozenset()
    grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) else None for o in outputs]
    fake_mode = detect_fake_mode([o for o in outputs if isinstance(o, torch.Tensor)])
    try:
        # Quietly: a backward that cannot run on fake tensors is expected, and handled below.
        with contextlib.ExitStack() as stack:
            stack.enter_context(no_interception())
            stack.enter_context(torch.no_grad())
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            if fake_mode is not None and fake_mode.shape_env is not None:
                # A backward that logs ``grad.abs().mean().item()`` makes an unbacked symbol here,
                # which no graph returns: left pending, AOTAutograd's trace failed on it
                # (PendingUnbackedSymbolNotFound) and, until wave 42, the model fell back to
                # PyTorch for good at its first dynamic capture.
                stack.enter_context(no_pending_unbacked_symbols(fake_mode.shape_env))
            result = call.cls.backward(ctx, *grads)
    except Exception as error:
        logger.debug(
            "%s: backward on fake tensors failed (%s); None gradients become zeros", call.func_name, error
        )
        return frozenset()
    result = result if isinstance(result, tuple) else (result,)
    return frozenset(
        k
        for k, (position, need) in enumerate(zip(call.tensor_positions, call.needs_grad, strict=True))
        if need and (position >= len(result) or result[position] is None)
    )


@torch.library.register_fake("ortrain::python_op", lib=LIBRARY)
def _python_op_fake(inputs: list[torch.Tensor], call_id: int) -> list[torch.Tensor]:
    call = lookup_call(call_id)
    # Fresh tensors: the op's outputs alias neither its inputs nor each other.
    outputs = [
        inputs[0].new_empty(shape, dtype=dtype, device=device) for shape, dtype, device in call.output_meta
    ]
    if call.keep_ctx:
        outputs.append(inputs[0].new_empty((0,), dtype=torch.int64))
    return outputs


@torch.library.register_fake("ortrain::python_op_grad", lib=LIBRARY)
def _python_op_grad_fake(
    handle: torch.Tensor, grad_outputs: list[torch.Tensor | None], call_id: int, sizes: list[Any]
) -> list[torch.Tensor]:
    call = lookup_call(call_id)
    grads, offset = [], 0
    for rank, dtype, device in zip(call.grad_ranks, call.grad_dtypes, call.grad_devices, strict=True):
        grads.append(torch.empty(list(sizes[offset : offset + rank]), dtype=dtype, device=device))
        offset += rank
    return grads


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    tensors, call_id = inputs
    call = lookup_call(call_id)
    ctx.call_id = call_id
    ctx.needs = [t.requires_grad for t in tensors]
    ctx.sizes = [size for t, need in zip(tensors, ctx.needs, strict=True) if need for size in t.shape]
    ctx.num_outputs = len(output) - 1
    non_differentiable = [output[i] for i in call.non_differentiable]
    if non_differentiable:
        ctx.mark_non_differentiable(*non_differentiable)
    ctx.save_for_backward(output[-1])
    # Gradients of unused outputs stay None so the Function's backward sees what eager would give
    # it: None under set_materialize_grads(False), zeros (materialized at run time) otherwise.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], None]:
    grad_outputs = list(grads[: ctx.num_outputs])
    if all(g is None for g in grad_outputs):
        return [None] * len(ctx.needs), None
    (handle,) = ctx.saved_tensors
    computed = iter(python_op_grad(handle, grad_outputs, ctx.call_id, ctx.sizes))
    none_grads = lookup_call(ctx.call_id).none_grads
    grads_in = [next(computed) if need else None for need in ctx.needs]
    return [None if k in none_grads else g for k, g in enumerate(grads_in)], None


torch.library.register_autograd("ortrain::python_op", _backward, setup_context=_setup_context, lib=LIBRARY)


def _not_in_torch(name: str) -> Callable[..., list[torch.Tensor]]:
    def kernel(*args: Any) -> list[torch.Tensor]:
        raise RuntimeError(
            f"ortrain::{name} runs only inside ortrain's python op executor "
            "(ortrain.runtime.executors.python_op), which calls the Function itself"
        )

    return kernel


# Graphs holding python ops run through ortrain's executors, never as a whole in PyTorch.
LIBRARY.impl("python_op", _not_in_torch("python_op"), "CompositeExplicitAutograd")
LIBRARY.impl("python_op_grad", _not_in_torch("python_op_grad"), "CompositeExplicitAutograd")


_state = threading.local()


def interception_enabled() -> bool:
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def no_interception() -> Iterator[None]:
    """Run nested Function calls as themselves (inside an opaque Function's forward, say)."""
    previous = interception_enabled()
    _state.enabled = False
    try:
        yield
    finally:
        _state.enabled = previous


def iter_python_op_nodes(graph: torch.fx.Graph) -> Iterator[torch.fx.Node]:
    return (n for n in graph.nodes if n.op == "call_function" and n.target in PYTHON_OPS)


def call_of(node: torch.fx.Node) -> FunctionCall:
    """The record of the Function call a ``python_op`` or ``python_op_grad`` node stands for."""
    call_id = node.args[1] if node.target is python_op else node.args[2]
    return lookup_call(int(call_id))  # type: ignore[arg-type]
