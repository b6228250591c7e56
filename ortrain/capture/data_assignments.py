"""``tensor.data = value`` inside a traced forward (MoCo's momentum encoder, some EMA teachers).

Traced as it is, the assignment swaps the storage of the traced tensor behind the tracer's back:
the graph's later reads of the tensor still read its input, the new value never reaches a
buffer or parameter, and the model trains on stale values without a word (wave 23: MoCo's key
encoder never moved, and the loss differed from eager's from the first step).

While a capture runs, ``Tensor.data``'s setter is replaced on the capturing thread. The
assignment of a value with the target's shape, dtype, device and layout, to a parameter or buffer
of the captured module, from a value computed in the forward (it shares no storage with a
parameter, buffer or input), becomes an in-place copy under ``no_grad``: an input mutation that
AOTAutograd writes back into the real tensor after each run, as it does for BatchNorm's running
statistics. The value is then what eager PyTorch gives the tensor. Eager PyTorch makes the
tensor share the value's storage instead of copying it; the two differ only if the forward
writes into the value afterwards, which is checked when the capture ends. Any other assignment
is refused with what to write instead, and the fallback policy decides.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ortrain.capture.tensor_attributes import storage_identity
from ortrain.capture.tensor_patches import tensor_attribute_replaced
from ortrain.errors import ORTModuleTorchModelException

_DATA = torch._C.TensorBase.__dict__["data"]  # the C-level property that plain tensors use
_local = threading.local()


IN_PLACE_ADVICE = (
    "a captured graph cannot replace a tensor's storage. Update it in place instead, e.g. "
    "`with torch.no_grad(): p.mul_(m).add_(q.detach(), alpha=1 - m)` or `p.copy_(value)`"
)


def _refusal(why: str) -> ORTModuleTorchModelException:
    return ORTModuleTorchModelException(
        f"the forward assigns `tensor.data = value` where {why}: {IN_PLACE_ADVICE}"
    )


class _Assignments:
    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.inputs: tuple[Any, ...] = ()  # the traced call's, set by a pre-hook on root
        self.copied: list[tuple[torch.Tensor, int]] = []

    def assign(self, target: torch.Tensor, value: torch.Tensor) -> None:
        if _same_view(target, value):
            # `module.to(dtype)` in a forward (Switch Transformers' router) sets `p.data = p` for
            # every parameter already of that dtype: nothing changes in eager, nor here.
            return
        state = [*self.root.parameters(), *self.root.buffers()]
        if not any(t is target for t in state):
            raise _refusal("the tensor is not a parameter or buffer of the model")
        if (value.shape, value.dtype, value.device, value.layout) != (
            target.shape,
            target.dtype,
            target.device,
            target.layout,
        ):
            raise _refusal(
                f"the value's shape, dtype or device ({list(value.shape)}, {value.dtype}, {value.device}) "
                f"is not the tensor's ({list(target.shape)}, {target.dtype}, {target.device})"
            )
        shared = storage_identity(value)
        inputs = [t for t in self.inputs if isinstance(t, torch.Tensor)]
        if shared is None or any(storage_identity(t) == shared for t in (*state, *inputs)):
            raise _refusal("the value shares its storage with a parameter, buffer or input")
        with torch.no_grad():
            target.copy_(value)
        self.copied.append((value, _mutations(value)))

    def check_values_unchanged(self) -> None:
        for value, mutations in self.copied:
            if _mutations(value) != mutations:
                raise _refusal("the forward writes into the value after assigning it")


def _same_view(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` is ``target``'s memory as it is: the same storage, offset, sizes,
    strides and dtype (the tensor itself, or its ``detach()``)."""
    if value is target:
        return True
    shared = storage_identity(value)
    return (
        shared is not None
        and shared == storage_identity(target)
        and (value.dtype, value.shape, value.stride(), value.storage_offset())
        == (target.dtype, target.shape, target.stride(), target.storage_offset())
    )


def _mutations(tensor: torch.Tensor) -> int:
    # The functional tensor's count of in-place writes; plain tensors (no functionalization) have
    # their version counter.
    elem = getattr(tensor, "elem", None)
    if elem is not None and torch._is_functional_tensor(elem):
        return torch._functionalize_mutation_counter(elem)
    return tensor._version


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    assignments: _Assignments | None = getattr(_local, "assignments", None)
    if assignments is None or not isinstance(value, torch.Tensor):
        _DATA.__set__(self, value)
        return
    assignments.assign(self, value)


_PROPERTY = property(_DATA.__get__, _set_data, doc=_DATA.__doc__)


@contextlib.contextmanager
def data_assignments_as_copies(root: nn.Module) -> Iterator[None]:
    """Within: ``p.data = value`` on this thread is an in-place copy into ``p`` (or refused)."""
    assignments = _Assignments(root)

    def record_inputs(_module: nn.Module, args: tuple[Any, ...]) -> None:
        assignments.inputs = args

    hook = root.register_forward_pre_hook(record_inputs)
    previous = getattr(_local, "assignments", None)
    _local.assignments = assignments
    try:
        with tensor_attribute_replaced("data", _PROPERTY):
            yield
        assignments.check_values_unchanged()
    finally:
        hook.remove()
        _local.assignments = previous
