"""``tensor.as_subclass(T)`` inside a traced forward: captured as the plain tensor, returned as a ``T``.

A forward that tags what it returns (``return logits.as_subclass(Logits)``) failed to capture:
``as_subclass`` on one of the trace's functional tensors raises "Attempting to use
FunctionalTensor on its own", and the model trained in PyTorch for good with that message as the
cause (found in wave 33). While a capture runs, ``Tensor.as_subclass`` is replaced on the
capturing thread: for a class that computes what a plain tensor computes (it overrides neither
``__torch_function__`` nor ``__torch_dispatch__``, :mod:`ortrain.capture.tensor_subclasses`) it
returns an alias of the tensor and remembers the class. PyTorch's default ``__torch_function__``
gives the results of operators on such a tensor its class (``tagged * 2`` is tagged too): the
capture's function mode (:mod:`ortrain.capture.function_overrides`) marks them the same way. An
output so marked goes back to the caller as that class (:mod:`ortrain.ortmodule.schema`), with its
autograd history, as in eager PyTorch. A class of the user's with code of its own around PyTorch's
operators is refused by name: a captured graph would not run that code. PyTorch's own classes
(``nn.Parameter``, the tracing tensors) get PyTorch's ``as_subclass``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ortrain.capture.held_objects import is_pytorch_class
from ortrain.capture.tensor_patches import tensor_attribute_replaced
from ortrain.capture.tensor_subclasses import keeps_its_class, overridden_protocols
from ortrain.errors import ORTModuleTorchModelException

_AS_SUBCLASS = torch._C.TensorBase.as_subclass
_local = threading.local()


def _as_subclass(self: torch.Tensor, cls: type) -> torch.Tensor:
    made: dict[int, tuple[torch.Tensor, type]] | None = getattr(_local, "made", None)
    if made is None or not isinstance(cls, type) or not issubclass(cls, torch.Tensor):
        return _AS_SUBCLASS(self, cls)
    plain = cls is torch.Tensor or keeps_its_class(cls)
    if not plain and is_pytorch_class(cls):
        return _AS_SUBCLASS(self, cls)  # PyTorch's own classes (nn.Parameter, its tracing tensors)
    if not plain:
        overridden = overridden_protocols(cls)
        raise ORTModuleTorchModelException(
            f"the forward makes a {cls.__qualname__} with as_subclass, a tensor class with its own "
            f"{' and '.join(overridden)}: a captured graph cannot run that code"
        )
    alias = self.view_as(self)  # another object: the tensor itself keeps its class
    made.pop(id(alias), None)  # marked with self's class by the function mode, if self has one
    if cls is not torch.Tensor:
        _mark(made, alias, cls)
    return alias


def _mark(made: dict[int, tuple[torch.Tensor, type]], tensor: torch.Tensor, cls: type) -> None:
    made[id(tensor)] = (tensor, cls)  # the tensor held, so that its id stays its own


def mark_results(args: Any, kwargs: Any, result: Any) -> None:
    """Give the tensors an operator returned the class of a marked tensor among its arguments,
    as PyTorch's default ``__torch_function__`` does; a no-op until the forward marks one."""
    made: dict[int, tuple[torch.Tensor, type]] | None = getattr(_local, "made", None)
    if not made:
        return
    leaves = pytree.tree_leaves((args, kwargs))
    found = next((cls for t in leaves if (cls := _class_in(made, t)) is not None), None)
    if found is None:
        return
    for t in pytree.tree_leaves(result):
        if isinstance(t, torch.Tensor):
            _mark(made, t, found)


def made_as(tensor: torch.Tensor) -> type | None:
    """The class the capturing forward gave ``tensor`` with ``as_subclass``, if it did."""
    made: dict[int, tuple[torch.Tensor, type]] | None = getattr(_local, "made", None)
    return _class_in(made, tensor) if made is not None else None


def _class_in(made: dict[int, tuple[torch.Tensor, type]], value: Any) -> type | None:
    found = made.get(id(value))
    return found[1] if found is not None and found[0] is value else None


@contextlib.contextmanager
def subclasses_as_plain_tensors() -> Iterator[None]:
    """Within, on this thread: ``as_subclass`` to a plain-computing class returns the tensor."""
    previous = getattr(_local, "made", None)
    _local.made = {}
    try:
        with tensor_attribute_replaced("as_subclass", _as_subclass):
            yield
    finally:
        _local.made = previous
