"""A hook below ``torch.autograd.Function.apply``: every call reaches it, however it was spelled.

Replacing the ``apply`` attribute of ``Function`` misses every reference taken before the capture
started: ``self.fn = MyFn.apply`` bound in ``__init__`` (Megatron's idiom), module-level aliases,
``functools.partial(MyFn.apply, ...)``. All of those are bound methods over one function object,
``Function.__dict__["apply"].__func__``. Swapping that object's ``__code__`` for a trampoline's
reaches them all, and putting the original code back restores every one of them exactly.

The trampoline has the same free variables as the original (``__class__``, for the zero-argument
``super()``), runs in ``torch.autograd.function``'s globals, and calls the hook installed there;
the hook calls a copy of the original function when it lets a call through.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch.autograd.function as function_module
from torch.autograd.function import Function

ApplyHook = Callable[[type[Function], tuple[Any, ...], dict[str, Any]], Any]

_HOOK_NAME = "_ortrain_apply_hook"


class _Trampoline:
    # Defined in a class so that the code object has ``__class__`` as its one free variable, like
    # the original ``apply``; the name below is looked up in torch.autograd.function's globals.
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        __class__  # noqa: B018  (keeps the free variable the original's closure provides)
        return _ortrain_apply_hook(cls, args, kwargs)  # type: ignore[name-defined]  # noqa: F821


_APPLY = Function.__dict__["apply"].__func__
_ORIGINAL_CODE = _APPLY.__code__
_TRAMPOLINE_CODE = _Trampoline.apply.__code__
if _TRAMPOLINE_CODE.co_freevars != _ORIGINAL_CODE.co_freevars:  # a torch upgrade changed apply
    raise ImportError(
        f"torch.autograd.Function.apply has free variables {_ORIGINAL_CODE.co_freevars}; ortrain's "
        f"trampoline has {_TRAMPOLINE_CODE.co_freevars}: update ortrain/capture/apply_hook.py"
    )
# The original behaviour, as a separate function object that the code swap does not touch.
original_apply = types.FunctionType(
    _ORIGINAL_CODE, _APPLY.__globals__, "apply", _APPLY.__defaults__, _APPLY.__closure__
)
original_apply.__kwdefaults__ = _APPLY.__kwdefaults__


@contextlib.contextmanager
def hooked_apply(hook: ApplyHook) -> Iterator[None]:
    """Route every ``Function.apply`` call through ``hook(cls, args, kwargs)`` for the duration.

    Nests: an inner hook replaces the outer one until it exits. The hook must call
    :data:`original_apply` for calls it does not claim (other threads' calls among them).
    """
    globals_ = vars(function_module)
    previous_hook = globals_.get(_HOOK_NAME)
    previous_code = _APPLY.__code__
    globals_[_HOOK_NAME] = hook
    _APPLY.__code__ = _TRAMPOLINE_CODE
    try:
        yield
    finally:
        _APPLY.__code__ = previous_code
        if previous_hook is None:
            globals_.pop(_HOOK_NAME, None)
        else:
            globals_[_HOOK_NAME] = previous_hook
