"""Ask eager PyTorch whether a failure is the user's, without changing the model or the inputs.

When capture or a graph run fails, ortrain runs the wrapped module eagerly on the same inputs:
if PyTorch raises too (a wrong shape or dtype, an index out of range, an inference tensor where
autograd must save one), that error is the one the user must see. The check runs in the mode the
user is in (no ``eval()``/``train()`` of any submodule), without gradients (its in-place writes
would leave autograd history on the caller's tensors, which the call's own writes then doubled)
except where an input is an inference tensor and the caller's mode computes gradients: there
autograd's refusal is the user's error (under ``no_grad`` such a batch passed, and sent the model
to PyTorch for good until wave 43). It puts back every buffer (BatchNorm statistics, counters),
the random number generators it may have advanced (PyTorch's, Python's and NumPy's), and the
memory of every tensor it wrote into that it did not make (:mod:`ortrain.capture.undone_writes`:
the call's inputs, parameters; ``x.mul_(2)`` in a forward ran twice at a fallback's call until
wave 43, and the loss of that call was eager's on ``4x``), so that the step it stands in for
leaves no trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ortrain.capture.undone_writes import (
    HigherOrderOperatorMet,
    WritesUndone,
    forget_interrupted_compiles,
    storage_key,
)
from ortrain.ortmodule.python_randomness import python_generators_kept, torch_generators_kept


def run_eagerly_leaving_no_trace(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``module(*args, **kwargs)`` for its exceptions only; raises what PyTorch raises."""
    inference = any(
        isinstance(t, torch.Tensor) and t.is_inference() for t in pytree.tree_leaves((args, kwargs))
    )
    if inference and torch.is_grad_enabled():
        _run_once(module, args, kwargs, torch.enable_grad())
        return
    try:
        _run_once(module, args, kwargs, torch.no_grad())
    except Exception:
        if not torch.is_grad_enabled():
            raise
        # A forward that differentiates inside (a force field's autograd.grad of its energy, a
        # PINN's derivatives) fails without gradients where the caller's mode runs it: the
        # caller's mode decides (wave 46's review: "element 0 of tensors does not require grad"
        # was raised as the user's error in place of the fallback the policy asks for).
        with _gradients_kept(module, args, kwargs):  # a backward inside accumulates into .grad
            _run_once(module, args, kwargs, torch.enable_grad())


@contextlib.contextmanager
def _gradients_kept(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Put back the ``.grad`` of the parameters and of the call's leaf tensors: a forward that runs
    a backward of its own (``aux_loss.backward()``) accumulates into them."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_leaf]
    kept = [(t, None if t.grad is None else t.grad.clone()) for t in (*module.parameters(), *leaves)]
    try:
        yield
    finally:
        for tensor, grad in kept:
            tensor.grad = grad


def _run_once(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], grad_mode: Any) -> None:
    saved = [
        (m, name, buffer, buffer.clone())
        for m in module.modules()
        for name, buffer in m._buffers.items()
        if buffer is not None
    ]
    writes = WritesUndone({key for _, _, buffer, _ in saved if (key := storage_key(buffer)) is not None})
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        # Every generator the forward may draw from is put back (wave 44: one the model held was
        # left one draw ahead, and every later step drew other numbers than eager's).
        kept = (python_generators_kept(module), torch_generators_kept(module))
        with torch.random.fork_rng(devices=cuda), kept[0], kept[1], grad_mode:
            try:
                with writes:
                    module(*args, **kwargs)
            except HigherOrderOperatorMet:
                forget_interrupted_compiles()
    finally:
        with torch.no_grad():
            writes.undo()
            for m, name, buffer, copy in saved:
                m._buffers[name] = buffer  # the same tensor object, in case forward replaced it
                if buffer.is_inference():
                    continue  # written in place only under inference_mode: replaced, if anything
                if buffer.shape == copy.shape:
                    buffer.copy_(copy)
                else:  # resized by the forward (a quantization observer's first call)
                    buffer.set_(copy)
