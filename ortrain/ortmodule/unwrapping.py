"""Let accelerate's ``extract_model_from_parallel`` unwrap an ``ORTModule`` as it unwraps DDP.

The Hugging Face ``Trainer`` saves through ``accelerator.unwrap_model(model)`` (and
``transformers.modeling_utils.unwrap_model`` delegates to the same function): only a
``PreTrainedModel`` found there is saved with ``save_pretrained``, which knows tied weights; anything
else is written as a raw state dict, which safetensors refuses when two names share storage
(GPT-2's ``wte`` and ``lm_head``). accelerate unwraps a fixed tuple of classes (DDP, DataParallel,
DeepSpeedEngine, FSDP) and offers no registry, so ortrain wraps the function once, in each module
that holds a reference to it, when accelerate is loaded: after accelerate's own unwrapping, an
``ORTModule`` it reaches is replaced by its ``module`` (and unwrapped again, for DDP inside).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ortrain.ortmodule")

# Modules that bind ``extract_model_from_parallel`` as a global name of their own.
_HOLDERS = (
    "accelerate.utils.other",
    "accelerate.utils",
    "accelerate.accelerator",
    "transformers.modeling_utils",
)
_MARK = "_ortrain_unwraps_ortmodule"


def _unwrapping(original: Callable[..., Any]) -> Callable[..., Any]:
    from ortrain.ortmodule.ortmodule import ORTModule

    @functools.wraps(original)
    def extract_model_from_parallel(model: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(model, *args, **kwargs)
        while isinstance(model, ORTModule):
            model = original(model.module, *args, **kwargs)
        return model

    setattr(extract_model_from_parallel, _MARK, True)
    return extract_model_from_parallel


_all_done = [False]


def teach_accelerate_to_unwrap() -> None:
    """Wrap ``extract_model_from_parallel`` in every loaded module that holds it.

    Idempotent and cheap: called each time ``ORTModule.forward`` is looked up, so that accelerate
    and transformers imported after the ``ORTModule`` was built are covered too.
    """
    if _all_done[0]:
        return
    other = sys.modules.get("accelerate.utils.other")
    if other is None:
        return
    current = other.extract_model_from_parallel
    if getattr(current, _MARK, False):
        original, patched = current.__wrapped__, current
    else:
        original, patched = current, _unwrapping(current)
        logger.debug("accelerate's extract_model_from_parallel now unwraps ORTModule")
    loaded = 0
    for name in _HOLDERS:
        holder = sys.modules.get(name)
        if holder is None:
            continue
        loaded += 1
        if getattr(holder, "extract_model_from_parallel", None) is original:
            holder.extract_model_from_parallel = patched  # type: ignore[attr-defined]
    _all_done[0] = loaded == len(_HOLDERS)
