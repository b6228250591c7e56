"""Writes into tensors a run did not make, undone afterwards (for ortrain's eager check).

A TorchDispatchMode sees every operator below autograd: before the first write into a tensor the
run did not make (an input, a parameter), it copies that tensor's memory, and :meth:`undo` writes
it back. See :mod:`ortrain.ortmodule.eager_check`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return None


class HigherOrderOperatorMet(Exception):
    """``torch.cond`` and its kin compile themselves in eager PyTorch, which failed under the mode
    (wave 43: "no rule registered for HigherOrderOperator cond"), and left TorchDynamo unable to
    run them afterwards when the mode handled them: such a forward is not checked (taken as fine),
    and TorchDynamo forgets what it compiled meanwhile (:func:`forget_interrupted_compiles`)."""


class WritesUndone(TorchDispatchMode):
    """Copies the memory of each tensor the check did not make before the first write into it,
    and writes it back afterwards. A tensor is the check's own when an operator made it in new
    memory (not a view sharing an argument's)."""

    supports_higher_order_operators = True

    def __init__(self, left_alone: set[tuple[str, int]]) -> None:
        super().__init__()
        self.made: set[tuple[str, int]] = set()
        self.left_alone = left_alone  # the buffers: put back by the check itself
        self.saved: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            raise HigherOrderOperatorMet
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name) if argument.kwarg_only else (
                args[position] if position < len(args) else kwargs.get(argument.name)
            )  # fmt: skip
            for tensor in _tensors(value):
                self._save(tensor)
        result = func(*args, **kwargs)
        arguments = {storage_key(t) for t in _tensors([*args, *kwargs.values()])}
        for tensor in _tensors(result):
            key = storage_key(tensor)
            if key is not None and key not in arguments:
                self.made.add(key)
        return result

    def _save(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        if key is None or key in self.made or key in self.left_alone or key in self.saved:
            return
        storage = tensor.untyped_storage()
        self.saved[key] = (storage, storage.clone())

    def undo(self) -> None:
        for storage, copy in self.saved.values():
            if storage.nbytes() == copy.nbytes():
                storage.copy_(copy)


def forget_interrupted_compiles() -> None:
    """TorchDynamo's caches, dropped after a higher-order operator met the mode: its compile,
    interrupted, left the branches' code marked as skipped, and the fallback's own eager call of
    ``torch.cond`` failed ("Attempted to call function marked as skipped")."""
    torch._dynamo.reset()
