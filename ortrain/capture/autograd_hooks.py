"""Autograd hooks that a forward installs for its own backward: gradient hooks on its tensors
(``h.register_hook(fn)``, ``h.retain_grad()``, ``p.register_post_accumulate_grad_hook(fn)``,
``torch.autograd.graph.register_multi_grad_hook``), hooks on their autograd nodes
(``h.grad_fn.register_hook(fn)``, ``register_prehook``) and saved-tensor hooks around a region
(``with torch.autograd.graph.saved_tensors_hooks(pack, unpack):``).

Such a hook belongs to the autograd graph of one call: it runs in that call's backward, or on
what that call saves for it. A captured graph installed it once, while tracing, and never ran it:
a gradient-reversal or gradient-scaling hook on an activation was silently ignored (wave 29: the
gradients were 0.2 off from the first step), a Grad-CAM hook never saw a gradient, a retained
activation's ``.grad`` stayed ``None``, and activations packed lossily (rounded to bfloat16, as
activation compression does) were saved exact, so the gradients were not eager's (4e-4 off).
TorchDynamo breaks the graph there and runs the call eagerly at every step, as eager PyTorch does.

So capture runs with these watched, and a capture during which the user's forward installed one
is refused with :class:`AutogradHookError`: the model then trains through TorchDynamo's graph
breaks. An autograd node is a C object whose methods cannot be replaced, so while capturing, the
user's forward reads ``tensor.grad_fn`` as a stand-in that is the node in every other respect
(:class:`_WatchedNode`; the nodes reached from it, ``next_functions``, are not watched). Let
through: a gradient hook on a tensor that requires no gradient (eager PyTorch's own error, or
nothing to do), PyTorch's own saved-tensor hooks (``save_on_cpu`` keeps the values, and activation
checkpointing is ortrain's to capture), and calls from PyTorch's code or outside the user's
forward.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from ortrain.capture.differentiating_hooks import DifferentiatingHookError, differentiates
from ortrain.capture.function_overrides import grad_of_a_traced_leaf
from ortrain.capture.generator_resets import in_user_forward

_TENSOR_METHODS = ("register_hook", "register_post_accumulate_grad_hook", "retain_grad")


_GRAD_FN = torch._C.TensorBase.__dict__["grad_fn"]  # the C properties plain tensors use
_GRAD = torch._C.TensorBase.__dict__["grad"]


class AutogradHookError(RuntimeError):
    """The forward installed an autograd hook for its own backward while it was captured."""


class _WatchedNode:
    """A traced tensor's ``grad_fn`` as the user's forward sees it while captured: the node, except
    that registering a hook on it is refused."""

    __slots__ = ("_node", "_refuse")

    def __init__(self, node: Any, refuse: Callable[..., None]) -> None:
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_refuse", refuse)

    def register_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("grad_fn.register_hook", *args[:1])

    def register_prehook(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("grad_fn.register_prehook", *args[:1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(h.grad_fn, Node) / AddmmBackward0 answers as for the node
        return type(self._node)

    def __eq__(self, other: object) -> bool:
        return self._node == (other._node if isinstance(other, _WatchedNode) else other)

    def __hash__(self) -> int:
        return hash(self._node)

    def __repr__(self) -> str:
        return repr(self._node)


# Frames that pass a property read on rather than make it: torch function modes (ortrain's own,
# proxy tracing's) re-dispatch ``p.grad`` read by ``Module._apply`` inside a ``module.to()`` call.
_PASSING_ON = (
    "ortrain.",
    "torch.overrides",
    "torch.fx.experimental.proxy_tensor",
    "torch.utils._python_dispatch",
)


def _called_from_torch() -> bool:
    """Whether PyTorch's code read the property (frames that pass the read on skipped)."""
    frame = sys._getframe(2)  # this function's caller is the getter; its caller, the reader
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(_PASSING_ON):
        frame = frame.f_back
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("torch.")


def _users(hooks: saved_tensors_hooks) -> bool:
    """Whether a saved-tensor hook is the user's: the base class with the user's functions, or a
    subclass outside PyTorch."""
    kind = type(hooks)
    return kind is saved_tensors_hooks or not kind.__module__.startswith("torch.")


@contextlib.contextmanager
def refusing_autograd_hooks() -> Iterator[None]:
    """Raise :class:`AutogradHookError` if a user forward run by the body installed a gradient
    hook on a tensor that requires a gradient, or entered saved-tensor hooks of the user's (the
    body's own error, if any, is its cause)."""
    called: list[str] = []
    differentiating: list[str] = []

    def refuse(what: str, hook: object = None) -> None:
        called.append(what)
        if differentiates(hook):
            differentiating.append(what)
        # Stop the trace here: the hook must not act on traced values either.
        raise AutogradHookError(f"the forward calls {what}")

    def watched_method(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if in_user_forward() and tensor.requires_grad:
                refuse(f"Tensor.{name}", *args[:1])
            return original(tensor, *args, **kwargs)

        return call

    enter = saved_tensors_hooks.__enter__

    @functools.wraps(enter)
    def watched_enter(hooks: saved_tensors_hooks) -> None:
        if in_user_forward() and _users(hooks):
            refuse(f"{type(hooks).__name__} (saved-tensor hooks)")
        enter(hooks)

    def grad_fn(tensor: torch.Tensor) -> Any:
        node = _GRAD_FN.__get__(tensor)
        # A tensor subclass (a traced FunctionalTensor) reads its grad_fn through this property
        # again, from C: the node may come back watched already.
        if node is None or type(node) is _WatchedNode or not in_user_forward() or _called_from_torch():
            return node
        return _WatchedNode(node, refuse)

    def grad(tensor: torch.Tensor) -> Any:
        if in_user_forward() and tensor.requires_grad and not _called_from_torch():
            refuse("Tensor.grad")
        return grad_of_a_traced_leaf(tensor)  # without the non-leaf warning eager never gives

    # retain_grad, grad_fn and grad are inherited from the C class: set on torch.Tensor, then deleted.
    originals = {name: torch.Tensor.__dict__.get(name) for name in (*_TENSOR_METHODS, "grad_fn", "grad")}
    for name in _TENSOR_METHODS:
        setattr(torch.Tensor, name, watched_method(name, getattr(torch.Tensor, name)))
    torch.Tensor.grad_fn = property(grad_fn, doc=_GRAD_FN.__doc__)  # type: ignore[method-assign, assignment]
    torch.Tensor.grad = property(grad, _GRAD.__set__, _GRAD.__delete__, doc=_GRAD.__doc__)  # type: ignore[method-assign, assignment]
    saved_tensors_hooks.__enter__ = watched_enter  # type: ignore[method-assign]
    try:
        yield
    finally:
        saved_tensors_hooks.__enter__ = enter  # type: ignore[method-assign]
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        if differentiating:
            raise DifferentiatingHookError(", ".join(dict.fromkeys(differentiating)))
        if "Tensor.grad" in called:
            raise AutogradHookError(
                "the forward reads a gradient an earlier backward left (Tensor.grad): a captured "
                "graph would keep what it read while tracing"
            )
        if called:
            raise AutogradHookError(
                f"the forward installs an autograd hook for its own backward "
                f"({', '.join(dict.fromkeys(called))}): a captured graph would install it once, "
                "while tracing, and its backward would never run it"
            )
