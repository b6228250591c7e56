"""Ask eager PyTorch whether a failure is the user's, without changing the model or the inputs.

When capture or a graph run fails, ortrain runs the wrapped module eagerly on the same inputs:
if PyTorch raises too (a wrong shape or dtype, an index out of range, an inference tensor where
autograd must save one), that error is the one the user must see. The check runs in the mode the
user is in (no ``eval()``/``train()`` of any submodule, the caller's gradient mode: under
``no_grad`` an inference tensor passed, and one bad batch sent the model to PyTorch for good
until wave 43), and puts back every buffer (BatchNorm statistics, counters), the random number
generators it may have advanced (PyTorch's, Python's and NumPy's), and the memory of every tensor
it wrote into that it did not make (the call's inputs, parameters: ``x.mul_(2)`` in a forward ran
twice at a fallback's call until wave 43, and the loss of that call was eager's on ``4x``), so
that the step it stands in for leaves no trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ortrain.ortmodule.python_randomness import python_generators_kept


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return None


class _WritesUndone(TorchDispatchMode):
    """Copies the memory of each tensor the check did not make before the first write into it,
    and writes it back afterwards. A tensor is the check's own when an operator made it in new
    memory (not a view sharing an argument's)."""

    def __init__(self, left_alone: set[tuple[str, int]]) -> None:
        super().__init__()
        self.made: set[tuple[str, int]] = set()
        self.left_alone = left_alone  # the buffers: put back by the check itself
        self.saved: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name) if argument.kwarg_only else (
                args[position] if position < len(args) else kwargs.get(argument.name)
            )  # fmt: skip
            for tensor in _tensors(value):
                self._save(tensor)
        result = func(*args, **kwargs)
        arguments = {_storage_key(t) for t in _tensors([*args, *kwargs.values()])}
        for tensor in _tensors(result):
            key = _storage_key(tensor)
            if key is not None and key not in arguments:
                self.made.add(key)
        return result

    def _save(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key is None or key in self.made or key in self.left_alone or key in self.saved:
            return
        storage = tensor.untyped_storage()
        self.saved[key] = (storage, storage.clone())

    def undo(self) -> None:
        for storage, copy in self.saved.values():
            if storage.nbytes() == copy.nbytes():
                storage.copy_(copy)


def run_eagerly_leaving_no_trace(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``module(*args, **kwargs)`` for its exceptions only; raises what PyTorch raises."""
    saved = [
        (m, name, buffer, buffer.clone())
        for m in module.modules()
        for name, buffer in m._buffers.items()
        if buffer is not None
    ]
    writes = _WritesUndone({key for _, _, buffer, _ in saved if (key := _storage_key(buffer)) is not None})
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda), python_generators_kept(module), writes:
            module(*args, **kwargs)
    finally:
        with torch.no_grad():
            writes.undo()
            for m, name, buffer, copy in saved:
                m._buffers[name] = buffer  # the same tensor object, in case forward replaced it
                if buffer.shape == copy.shape:
                    buffer.copy_(copy)
                else:  # resized by the forward (a quantization observer's first call)
                    buffer.set_(copy)
