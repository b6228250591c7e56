"""``ORTModule.forward`` shows the wrapped module's signature to libraries that inspect it.

The Hugging Face ``Trainer`` reads ``inspect.signature(model.forward)`` to choose which dataset
columns to keep (and whether the model takes ``num_items_in_batch``); a wrapper whose forward is
``(*args, **kwargs)`` gets an empty batch. The class attribute stays the plain function, so
``nn.Module.__call__``, hooks, DDP and pickling see an ordinary method; only the per-instance bound
object carries the wrapped module's signature. Looking the method up also lets accelerate unwrap
the ``ORTModule`` (see :mod:`ortrain.ortmodule.unwrapping`), so that libraries loaded after the
wrapper was built are covered.

Some libraries read the signature off the model's *class*: the Trainer finds its label names with
``find_labels(type(model))`` (the ``forward`` parameters containing "label"), and whether the model
returns a loss with ``can_return_loss(type(model))``. So each wrapped class gets a subclass of
``ORTModule`` of its own (``ORTModule[GPT2LMHeadModel]``, made once per class), whose class-level
``forward`` reports the wrapped class's signature; ``ORTModule.forward`` itself stays
``(self, *args, **kwargs)``. Pickles and copies name ``ORTModule`` and the wrapped class, never the
made subclass.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ortrain.ortmodule.container_access import container_methods
from ortrain.ortmodule.unwrapping import teach_accelerate_to_unwrap


class BoundForward:
    """``instance.forward``: calls the wrapper's forward, reports the wrapped module's signature."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, func: Callable[..., Any], instance: Any) -> None:
        self.__func__ = func
        self.__self__ = instance

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # As a bound method does: the function's own attributes (`__code__`, which torch.export
        # reads to name its symbolic sizes, `__globals__`, `__defaults__`). Not the slots, which are
        # unset while TorchDynamo builds the object (looking them up here recursed).
        if name in BoundForward.__slots__:
            raise AttributeError(name)
        return getattr(self.__func__, name)

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
            wrapped = getattr(owner, _WRAPPED_CLASS, None)
            return self._func if wrapped is None else _class_forward(self._func, wrapped)
        teach_accelerate_to_unwrap()
        return BoundForward(self._func, instance)


@functools.cache
def _class_forward(func: Callable[..., Any], wrapped: type) -> Callable[..., Any]:
    """``WrapperClass.forward``: the wrapper's function, showing ``wrapped.forward``'s signature."""

    @functools.wraps(func)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return func(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(wrapped.forward)  # type: ignore[attr-defined]
    return forward


_WRAPPED_CLASS = "_ortrain_wrapped_class"
_BASE_CLASS = "_ortrain_base_class"


@functools.cache
def _subclass_for(base: type, wrapped: type) -> type:
    namespace = {
        "__module__": base.__module__,
        "__qualname__": f"{base.__qualname__}[{wrapped.__qualname__}]",
        "__doc__": base.__doc__,
        _WRAPPED_CLASS: wrapped,
        _BASE_CLASS: base,
        **container_methods(wrapped),  # model[i], len(model), iteration
    }
    return type(f"{base.__name__}[{wrapped.__name__}]", (base,), namespace)


def wrapper_class_for(cls: type, module: Any) -> type:
    """The class to instantiate when ``cls`` (ORTModule or a subclass) wraps ``module``."""
    if getattr(cls, _WRAPPED_CLASS, None) is not None or not isinstance(module, nn.Module):
        return cls
    return _subclass_for(cls, type(module))


def base_wrapper_class(cls: type) -> type:
    """The class a made subclass was made from (what pickles name)."""
    return getattr(cls, _BASE_CLASS, cls)


def new_wrapper(base: type, wrapped: type) -> Any:
    """An empty wrapper of ``base`` for a module of class ``wrapped`` (unpickling calls this)."""
    return object.__new__(_subclass_for(base, wrapped))


def wrapped_module_signature(func: Callable[..., Any]) -> Any:
    """Decorate a wrapper's ``forward``: ``inspect.signature(wrapper.forward)`` is that of
    ``wrapper.module.forward``."""
    return _ForwardWithWrappedSignature(func)
