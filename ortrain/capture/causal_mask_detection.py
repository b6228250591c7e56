"""``nn.Transformer`` and ``nn.TransformerEncoder`` given a mask without ``is_causal`` are captured whole.

Called the usual way (``encoder(x, mask=causal_mask)``), PyTorch asks whether the mask is causal
by comparing its values (``bool((mask == causal).all())`` in
``torch.nn.modules.transformer._detect_is_causal_mask``): data-dependent Python, so the capture
of the whole model failed and TorchDynamo split it at that line, handing ortrain a graph of two
nodes and running the encoder's layers in eager PyTorch, without a word (wave 42).

The answer only picks how attention applies the mask: ``is_causal=True`` lets it use a causal
kernel instead of reading the mask, ``False`` reads the mask itself, whose values are the same
causal ones. So while capturing, a mask whose causality was not stated is read as given (``False``),
and the model's numbers are eager's. A stated ``is_causal`` is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.nn.modules import transformer


def _read_as_given(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
    return is_causal is True


@contextlib.contextmanager
def causal_masks_read_as_given() -> Iterator[None]:
    """While capturing: ``_detect_is_causal_mask`` compares no values (see the module)."""
    original = transformer._detect_is_causal_mask
    transformer._detect_is_causal_mask = _read_as_given
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original
