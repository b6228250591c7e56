"""What every ortrain capture runs under, whichever entry point (ORTModule or torch.compile) traced.

- Flash attention for large attention calls, the math form for the others (see
  :mod:`ortrain.capture.attention_kernel`): the math form decomposes into ops with ONNX
  translations, backward included; flash runs in PyTorch and needs no seq x seq tensor.
- Hugging Face masks built without data-dependent checks (see :mod:`ortrain.capture.huggingface`).
- ``torch.compiler.is_compiling()`` answers ``True``: libraries ask it to pick a code path that
  can be traced (a mixture-of-experts layer that loops over ``offs.tolist()`` eagerly, say, or
  one that calls a kernel whose tracing rules differ from its eager kernel). AOTAutograd alone
  does not set it, so without this a library takes its *eager* path while being traced: it hits
  a data-dependent error, or a kernel whose fake implementation rejects the dtype at hand
  ("Expected inputs of BF16 type" for a float32 model). torch.export sets the same flag.
- ``capturing()`` answers ``True`` on the capturing thread: an ``ORTModule`` met inside the
  model being captured (a wrapped submodule, or a wrapper wrapped again) then runs its model's
  forward into the outer graph instead of capturing and running graphs of its own on traced
  values (wave 15: "invalid python storage" under ``FALLBACK_DISABLE``; otherwise the inner
  wrapper fell back to PyTorch for good and the outer failed at every step).
- Fake tensors' "failed while attempting to run meta" tracebacks stay out of the user's stderr:
  a capture that fails is handled (the user's own error from eager PyTorch for bad inputs, the
  fallback policy otherwise, the capture's error at DEBUG), and a wrong input shape printed
  forty lines of ERROR before PyTorch's one-line answer. So do anomaly mode's "Error detected in
  IndexPutBackward0" warnings, which AOTAutograd's trace of the backward (run under anomaly
  detection) printed with the forward's source line for every capture that failed there.
- TorchScript parts run op by op (see :mod:`ortrain.capture.torchscript_calls`): an optimized
  plan hid its ops, and their gradients, from the trace.
- Saved-tensor hooks around the wrapper (``torch.utils.checkpoint.checkpoint(model, x)``,
  ``torch.autograd.graph.save_on_cpu``) do not see what tracing saves: a first step captured
  inside a non-reentrant checkpoint counted the trace's fake tensors as saved by the forward
  and failed ("a different number of tensors was saved during the original forward and
  recomputation"). The hooks see what the captured forward saves when it runs, as for eager.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator

import torch

from ortrain.capture.attention_kernel import attention_kernel_choice
from ortrain.capture.distribution_validation import distribution_checks_off
from ortrain.capture.huggingface import hf_masks_traceable
from ortrain.capture.tensor_python_attributes import python_attributes_carried
from ortrain.capture.torchscript_calls import torchscript_unoptimized


@contextlib.contextmanager
def reports_compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is ``True`` inside (process-wide, as torch.export does)."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


class _MetaFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


@contextlib.contextmanager
def capture_failures_unshown() -> Iterator[None]:
    """Fake tensors' meta-failure tracebacks and anomaly mode's "Error detected in" warnings of a
    failing trace stay out of the user's stderr (see the module)."""
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _MetaFailures()
    fake_logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Error detected in ", category=UserWarning)
            yield
    finally:
        fake_logger.removeFilter(quiet)


_thread = threading.local()


def capturing() -> bool:
    """Whether this thread is inside an ortrain capture."""
    return getattr(_thread, "depth", 0) > 0


@contextlib.contextmanager
def _counted() -> Iterator[None]:
    _thread.depth = getattr(_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _thread.depth -= 1


@contextlib.contextmanager
def saved_tensor_hooks_ignored() -> Iterator[None]:
    """The user's saved-tensor hooks are skipped while tracing, as TorchDynamo skips them."""
    previous = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(previous)


@contextlib.contextmanager
def tracing_context() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(_counted())
        stack.enter_context(attention_kernel_choice())
        stack.enter_context(hf_masks_traceable())
        stack.enter_context(reports_compiling())
        stack.enter_context(capture_failures_unshown())
        stack.enter_context(saved_tensor_hooks_ignored())
        stack.enter_context(torchscript_unoptimized())
        stack.enter_context(python_attributes_carried())
        stack.enter_context(distribution_checks_off())  # see capture/distribution_validation.py
        yield
