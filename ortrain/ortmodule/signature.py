"""``ORTModule.forward`` shows the wrapped module's signature to libraries that inspect it.

The Hugging Face ``Trainer`` reads ``inspect.signature(model.forward)`` to choose which dataset
columns to keep (and whether the model takes ``num_items_in_batch``); a wrapper whose forward is
``(*args, **kwargs)`` gets an empty batch. The class attribute stays the plain function, so
``nn.Module.__call__``, hooks, DDP and pickling see an ordinary method; only the per-instance bound
object carries the wrapped module's signature. Looking the method up also lets accelerate unwrap
the ``ORTModule`` (see :mod:`ortrain.ortmodule.unwrapping`), so that libraries loaded after the
wrapper was built are covered.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ortrain.ortmodule.unwrapping import teach_accelerate_to_unwrap


class BoundForward:
    """``instance.forward``: calls the wrapper's forward, reports the wrapped module's signature."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, func: Callable[..., Any], instance: Any) -> None:
        self.__func__ = func
        self.__self__ = instance

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__.module.forward)

    @property
    def __name__(self) -> str:
        return self.__func__.__name__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BoundForward):
            return NotImplemented
        return other.__func__ is self.__func__ and other.__self__ is self.__self__

    def __hash__(self) -> int:
        return hash((self.__func__, id(self.__self__)))

    def __repr__(self) -> str:
        return f"<bound method {type(self.__self__).__name__}.forward{self.__signature__}>"


class _ForwardWithWrappedSignature:
    def __init__(self, func: Callable[..., Any]) -> None:
        self._func = func
        self.__doc__ = func.__doc__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self._func
        teach_accelerate_to_unwrap()
        return BoundForward(self._func, instance)


def wrapped_module_signature(func: Callable[..., Any]) -> Any:
    """Decorate a wrapper's ``forward``: ``inspect.signature(wrapper.forward)`` is that of
    ``wrapper.module.forward``."""
    return _ForwardWithWrappedSignature(func)
