"""Which kernel a captured ``scaled_dot_product_attention`` becomes: PyTorch's flash kernel.

Capture lets the dispatcher pick flash attention (``_scaled_dot_product_flash_attention_for_cpu``
and its backward), as eager does on the CPU: it never materializes the batch x heads x seq x seq
probabilities, saves one log-sum-exp a row and works in blocks. Where the flash kernel does not
apply (dropout on the CPU, a mask that needs a gradient, a head size it does not support, ...)
the dispatcher takes the math form (``softmax(q @ k^T) @ v``, decomposed) by itself.

Where the graph runs is decided later, per node, by the partitioner: PyTorch runs the kernel
itself, ONNX Runtime runs small attention calls as the same computation written out in math
(:mod:`ortrain.export.flash_attention_math`, the threshold in
:mod:`ortrain.runtime.torch_native_ops`). Until wave 9 the choice was made here, at capture, by
size: small calls were traced in their math form for ONNX Runtime, so a graph the op tuner then
gave to PyTorch ran PyTorch's math attention (bmm, a safe softmax, copies) where eager runs flash:
1.14x eager's step on the tiny GPT at sequence 128 against 1.08x with flash (2-core Intel Xeon).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.nn.attention import SDPBackend, sdpa_kernel

# A size only known at run time (unbacked) counts as large: flash needs no seq x seq memory.
_UNKNOWN_SIZE = 2**20


def probability_bytes(query: torch.Tensor, key: torch.Tensor) -> int:
    """Bytes of the probabilities the math form would build, at the sizes being traced."""
    # Size hints, not the symbolic sizes themselves: comparing those would add a guard.
    rows = math.prod(optimization_hint(size, _UNKNOWN_SIZE) for size in query.shape[:-1])
    return rows * optimization_hint(key.shape[-2], _UNKNOWN_SIZE) * query.element_size()


@contextlib.contextmanager
def attention_kernel_choice() -> Iterator[None]:
    """Inside, attention calls take the flash kernel where it applies, the math form elsewhere."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        yield
