"""Which kernel a captured ``scaled_dot_product_attention`` becomes: flash attention or the math form.

The math form (``softmax(q @ k^T) @ v``, decomposed) has ONNX translations, forward and backward,
and runs in ONNX Runtime between the linear layers around it. Its probabilities are a batch x
heads x seq x seq tensor: stashed for the backward or rebuilt there (memory level 0 rebuilds them),
and in any case materialized, with the scores and their gradients, once per layer and step.

PyTorch's flash attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward) never materializes them: it saves one log-sum-exp per row and works in blocks. It has
no ONNX equivalent, so it runs in PyTorch (:mod:`ortrain.runtime.torch_native_ops`), and each call
costs two crossings between ONNX Runtime and PyTorch a step (about 1-3 ms each here: PyTorch's
OpenMP threads keep spinning on the cores ONNX Runtime needs next, unless
``OMP_WAIT_POLICY=PASSIVE``). The crossings cost the same at any size, the work flash saves grows
with the probabilities, so the capture picks flash where the probabilities are large.

Measured, tiny GPT (4 layers, 4 heads of 64, batch 8; 2-core AMD EPYC, medians of alternated
processes, OpenMP policy unset), step with flash against the math form: sequence 128 (2 MiB of
probabilities per call) 352-358 against 331-339 ms, 256 (8 MiB) 690-691 against 718-780, 512 (32 MiB)
1491-1658 against 2014-2037. Hence the threshold of 4 MiB.

Where flash does not apply (dropout on the CPU, a mask that needs a gradient, a head size it does
not support, ...) PyTorch's dispatcher falls back to the math form by itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

# Probabilities (batch x heads x query length x key length) of at least this many bytes per call.
FLASH_MIN_PROBABILITY_BYTES = 4 * 2**20

_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)

# A size only known at run time (unbacked) counts as large: flash needs no seq x seq memory.
_UNKNOWN_SIZE = 2**20


def probability_bytes(query: torch.Tensor, key: torch.Tensor) -> int:
    """Bytes of the probabilities the math form would build, at the sizes being traced."""
    # Size hints, not the symbolic sizes themselves: comparing those would add a guard.
    rows = math.prod(optimization_hint(size, _UNKNOWN_SIZE) for size in query.shape[:-1])
    return rows * optimization_hint(key.shape[-2], _UNKNOWN_SIZE) * query.element_size()


class _AttentionKernelChoice(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA or len(args) < 2:
            return func(*args, **kwargs)
        query, key = args[0], args[1]
        if probability_bytes(query, key) < FLASH_MIN_PROBABILITY_BYTES:
            return func(*args, **kwargs)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            return func(*args, **kwargs)


@contextlib.contextmanager
def attention_kernel_choice() -> Iterator[None]:
    """Inside, large attention calls may use flash attention (the math backend stays the default)."""
    with sdpa_kernel(SDPBackend.MATH), _AttentionKernelChoice():
        yield
