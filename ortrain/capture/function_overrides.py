"""PyTorch functions that the capture replaces by a traceable formulation, above autograd.

A decomposition table acts below autograd, after AOTAutograd's metadata pass has already run
each op on fake tensors: an op whose output shape depends on values (``_ctc_loss``'s alpha table)
fails there. A TorchFunctionMode, active only while capturing, swaps the Python-level function
for one written with static shapes, which autograd then differentiates. (And reads a traced
parameter's ``.grad`` without the non-leaf warning eager never gives.)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from ortrain.capture.affine_grids import OVERRIDES as AFFINE_GRIDS
from ortrain.capture.boolean_mask_assignment import OVERRIDES as BOOLEAN_MASK_ASSIGNMENT
from ortrain.capture.byte_class_labels import OVERRIDES as BYTE_CLASS_LABELS
from ortrain.capture.certain_dropout import OVERRIDES as CERTAIN_DROPOUT
from ortrain.capture.decompositions import refuse_sparse
from ortrain.capture.decompositions_ctc import ctc_loss_function
from ortrain.capture.decompositions_rnn import recurrent_overrides
from ortrain.capture.generator_resets import refuse_own_generators
from ortrain.capture.lifted_numbers import OVERRIDES as LIFTED_NUMBERS
from ortrain.capture.lifted_numbers import mark_numbers_computed, number_lookups_refused
from ortrain.capture.margin_losses import OVERRIDES as MARGIN_LOSSES
from ortrain.capture.mixed_precision_norms import OVERRIDES as MIXED_PRECISION_NORMS
from ortrain.capture.outside_writes import note_write
from ortrain.capture.recurrent_layers import recurrent_python_ops
from ortrain.capture.refused_index_dtypes import OVERRIDES as REFUSED_INDEX_DTYPES
from ortrain.capture.same_size_interpolation import OVERRIDES as SAME_SIZE_INTERPOLATION
from ortrain.capture.size_math import symbolic_math_of_sizes
from ortrain.capture.storage_views import OVERRIDES as STORAGE_VIEWS
from ortrain.capture.subclass_views import mark_results

_GRAD_GETTER = torch.Tensor.grad.__get__


def grad_of_a_traced_leaf(tensor: torch.Tensor) -> torch.Tensor | None:
    # While tracing, parameters are traced tensors that are not leaves: reading `p.grad` in a
    # forward (as `module.to()` does) warned about a non-leaf's .grad, which eager never shows.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf")
        return _GRAD_GETTER(tensor)


def _overrides(recurrent_as_python_ops: bool) -> dict[Callable[..., Any], Callable[..., Any]]:
    unrolled = recurrent_overrides()
    recurrent = recurrent_python_ops(unrolled) if recurrent_as_python_ops else unrolled
    # as_strided on a permuted tensor: see capture/storage_views.py
    return {
        torch.nn.functional.ctc_loss: ctc_loss_function,
        _GRAD_GETTER: grad_of_a_traced_leaf,
        **recurrent,
        **STORAGE_VIEWS,
        **_CORRECTIONS,
        **_SPARSE_CONVERSIONS,
        **LIFTED_NUMBERS,
    }


# Overrides that TorchDynamo's graphs (the graph-break path) need too. Half-precision inputs to
# float32 norms: see capture/mixed_precision_norms.py; PyTorch's decompositions of the margin losses
# and of nll_loss with uint8 labels: see capture/margin_losses.py, capture/byte_class_labels.py;
# `h[mask] = row`, whose backward needs the mask's count: capture/boolean_mask_assignment.py;
# `affine_grid` at an open size: capture/affine_grids.py; dropout at p = 1: capture/certain_dropout.py;
# an interpolation to the same size: capture/same_size_interpolation.py; one_hot of int32 and
# index_select of int8 indices, refused as eager refuses them: capture/refused_index_dtypes.py.
_CORRECTIONS = {
    **CERTAIN_DROPOUT,
    **SAME_SIZE_INTERPOLATION,
    **MIXED_PRECISION_NORMS,
    **MARGIN_LOSSES,
    **BYTE_CLASS_LABELS,
    **BOOLEAN_MASK_ASSIGNMENT,
    **AFFINE_GRIDS,
    **REFUSED_INDEX_DTYPES,
}


# Refused here, above autograd, before they run: traced, a compressed layout's output aborted the
# process inside autograd (``layout_impl is only implemented for TensorImpl subclasses``, thrown
# where no exception may pass: wave 44's review); the decomposition table's refusal came too late.
_SPARSE_CONVERSIONS: dict[Callable[..., Any], Callable[..., Any]] = {
    conversion: refuse_sparse
    for conversion in (
        torch.Tensor.to_sparse_csr,
        torch.Tensor.to_sparse_csc,
        torch.Tensor.to_sparse_bsr,
        torch.Tensor.to_sparse_bsc,
        torch.sparse_csr_tensor,
        torch.sparse_csc_tensor,
        torch.sparse_bsr_tensor,
        torch.sparse_bsc_tensor,
        torch.sparse_compressed_tensor,
    )
}


class _Overrides(TorchFunctionMode):
    def __init__(self, table: dict[Callable[..., Any], Callable[..., Any]]) -> None:
        super().__init__()
        self.table = table
        self.converting = 0  # real tensors being made fake: see _conversions_left_alone

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.converting:
            return func(*args, **kwargs)
        refuse_own_generators(kwargs)  # see capture/generator_resets.py
        note_write(func, args, kwargs)  # real tensors outside the model: see capture/outside_writes.py
        replacement = self.table.get(func)
        result = replacement(*args, **kwargs) if replacement is not None else NotImplemented
        if result is NotImplemented:
            result = func(*args, **kwargs)
        mark_results(args, kwargs, result)  # tensor subclasses: see capture/subclass_views.py
        mark_numbers_computed(func, args, kwargs, result)  # see capture/lifted_numbers.py
        return result


@contextlib.contextmanager
def _conversions_left_alone(mode: _Overrides) -> Iterator[None]:
    """Meanwhile, a real tensor made fake (a parameter, a buffer, an input) is made as PyTorch makes
    it: it rebuilds a view from its base with ``as_strided``, PyTorch's own addressing, not the
    model's. A ``LazyBatchNorm`` moved with ``.to(dtype)`` before its first call holds statistics
    that are views of an emptied base, which ``storage_views``' refusal failed (wave 47's review)."""
    original = FakeTensorMode.from_tensor

    @functools.wraps(original)
    def from_tensor(self: FakeTensorMode, *args: Any, **kwargs: Any) -> Any:
        mode.converting += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            mode.converting -= 1

    FakeTensorMode.from_tensor = from_tensor  # type: ignore[method-assign]
    try:
        yield
    finally:
        FakeTensorMode.from_tensor = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _active(mode: _Overrides) -> Iterator[None]:
    with mode, _conversions_left_alone(mode):
        yield


@contextlib.contextmanager
def function_overrides(*, recurrent_as_python_ops: bool) -> Iterator[None]:
    """``recurrent_as_python_ops``: recurrent layers over padded batches run as one opaque op each
    (:mod:`ortrain.capture.recurrent_layers`); otherwise, and for packed sequences, unrolled."""
    with (
        _active(_Overrides(_overrides(recurrent_as_python_ops))),
        number_lookups_refused(),
        symbolic_math_of_sizes(),
    ):
        yield


@contextlib.contextmanager
def dynamo_graph_overrides() -> Iterator[None]:
    """The overrides that correct what a trace computes, for AOTAutograd tracing a TorchDynamo
    graph (:mod:`ortrain.capture.dynamo_backend`)."""
    with _active(_Overrides(_CORRECTIONS)):
        yield
