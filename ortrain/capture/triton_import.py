"""TorchDynamo's first import, without Triton where Triton has nothing to run on.

``torch._dynamo`` imports Triton whenever it is installed (``torch._dynamo.utils``), GPU or not;
a CUDA build of PyTorch, the default ``pip install torch`` on Linux, installs it. On a machine
without a GPU that import is 67 MiB of resident memory and 0.2 s at start-up (2-core AMD EPYC,
Triton 3.9), about half of ortrain's extra peak against eager PyTorch on the MLP benchmark, for
kernels that cannot run: ortrain's own Triton kernels are for CUDA, and TorchDynamo and
AOTAutograd, which ortrain uses to capture, do not need it.

So where no CUDA or XPU device is present, Triton is left out of that one import (it reads as not
installed to the PyTorch modules imported then), and importable again right after: ``import
triton`` in the user's code works as before. ``ORTMODULE_USE_TRITON=1`` or ``TRITON_INTERPRET=1``
(Triton's CPU interpreter) keeps it. Nothing changes where TorchDynamo or Triton was imported
before ortrain (``torch.compile`` already used in the process).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from collections.abc import Iterator

import torch

logger = logging.getLogger("ortrain.capture")


# What ortrain imports of PyTorch's compiler stack: TorchDynamo, AOTAutograd (whose import reaches
# Inductor's code cache, which imports Triton too) and the backend helpers.
_MODULES = ("torch._dynamo", "torch._functorch.aot_autograd", "torch._dynamo.backends.common")


def import_dynamo(*, keep_triton: bool) -> None:
    """Import TorchDynamo and AOTAutograd; without Triton unless ``keep_triton`` or a GPU asks
    for it."""
    loaded = "torch._dynamo" in sys.modules or "triton" in sys.modules
    hide = not (loaded or keep_triton or _gpu_present())
    with _triton_hidden() if hide else contextlib.nullcontext():
        for name in _MODULES:
            importlib.import_module(name)
    if hide:
        logger.debug("imported TorchDynamo without Triton: no CUDA or XPU device")


@contextlib.contextmanager
def _triton_hidden() -> Iterator[None]:
    """``import triton`` raises ImportError inside the block, as if it were not installed."""
    sys.modules["triton"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        del sys.modules["triton"]


def _gpu_present() -> bool:
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())
