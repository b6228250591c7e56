"""What Hugging Face models need to be captured: traceable masks and cache objects as pytrees."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

logger = logging.getLogger("ortrain.capture")


@contextlib.contextmanager
def hf_masks_traceable() -> Iterator[None]:
    """Make ``transformers.masking_utils`` build masks without data-dependent checks.

    Hugging Face masks call ``padding_mask.all()`` unless they believe they are being traced, and
    their check misses AOTAutograd's functional tensors.
    """
    masking_utils = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as stack:
        if masking_utils is not None:
            for name in ("is_tracing", "is_torchdynamo_exporting"):
                if hasattr(masking_utils, name):
                    patched = _true_on_this_thread(getattr(masking_utils, name))
                    stack.enter_context(mock.patch.object(masking_utils, name, patched))
        yield


def _true_on_this_thread(original: Callable[..., Any]) -> Callable[..., Any]:
    """``True`` for the capturing thread; other threads, running models eagerly, get the real answer."""
    capturing_thread = threading.get_ident()

    def answer(*args: Any, **kwargs: Any) -> Any:
        return True if threading.get_ident() == capturing_thread else original(*args, **kwargs)

    return answer


def register_hf_cache_types() -> None:
    """Let ``DynamicCache`` outputs (GPT-2's ``past_key_values``) cross the graph boundary.

    transformers ships the pytree registration it uses for torch.export; ortrain reuses it.
    """
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except Exception:  # older or newer transformers without it: such outputs fall back
        logger.debug("transformers has no register_dynamic_cache_export_support")
        return
    register_dynamic_cache_export_support()
