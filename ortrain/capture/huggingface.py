"""What Hugging Face models need to be captured: traceable masks and cache objects as pytrees."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch.utils._pytree as pytree

logger = logging.getLogger("ortrain.capture")


@contextlib.contextmanager
def hf_masks_traceable() -> Iterator[None]:
    """Make ``transformers.masking_utils`` build masks without data-dependent checks.

    Hugging Face masks call ``padding_mask.all()`` unless they believe they are being traced, and
    their check misses AOTAutograd's functional tensors: ``is_tracing`` answers ``True``.

    ``is_torchdynamo_exporting`` is left alone: without a padding mask nothing is read, and Hugging
    Face then builds no mask, so that each attention layer's own ``is_causal`` applies, as in eager.
    Until wave 41 it answered ``True`` too, a causal mask was always built, and a decoder made
    bidirectional (``self_attn.is_causal = False``, as LLM2Vec does) trained causal (loss 4.834
    where eager gave 4.841).
    """
    masking_utils = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as stack:
        if masking_utils is not None and hasattr(masking_utils, "is_tracing"):
            patched = _true_on_this_thread(masking_utils.is_tracing)
            stack.enter_context(mock.patch.object(masking_utils, "is_tracing", patched))
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
    _register_encoder_decoder_cache()


def _register_encoder_decoder_cache() -> None:
    """Whisper and other encoder-decoders return an ``EncoderDecoderCache`` even when training
    (``use_cache`` defaults on): two ``DynamicCache``s, from which its only other state (which
    cross-attention layers are filled) is rebuilt."""
    from transformers.cache_utils import EncoderDecoderCache

    if EncoderDecoderCache in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        EncoderDecoderCache,
        lambda cache: ([cache.self_attention_cache, cache.cross_attention_cache], None),
        lambda children, _: EncoderDecoderCache(*children),
        serialized_type_name=f"{EncoderDecoderCache.__module__}.{EncoderDecoderCache.__name__}",
    )


def layered_cache(value: Any) -> tuple[dict[str, Any], list[tuple[type, dict[str, Any]]]] | None:
    """The attributes of a ``DynamicCache`` and of each of its layers, where a layer holds more
    than keys and values (else None: transformers' own pytree form serves). That form keeps keys
    and values only: a sliding-window layer's count of the tokens it has seen (Mistral, Gemma 2)
    came back reset, ``get_seq_length()`` 3 where eager says 10, and decoding from the returned
    cache went on at wrong positions."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or not isinstance(value, cache_utils.DynamicCache):
        return None
    if all(type(layer) is cache_utils.DynamicLayer for layer in value.layers):
        return None
    attributes = {k: v for k, v in value.__dict__.items() if k != "layers"}
    return attributes, [(type(layer), dict(layer.__dict__)) for layer in value.layers]


def rebuilt_cache(cls: type, attributes: dict[str, Any], layers: list[tuple[type, dict[str, Any]]]) -> Any:
    """The cache :func:`layered_cache` took apart, attribute for attribute (no ``__init__``: it
    would start the layers empty)."""
    cache = object.__new__(cls)
    cache.__dict__.update(attributes)
    cache.layers = []
    for layer_type, state in layers:
        layer = object.__new__(layer_type)
        layer.__dict__.update(state)
        cache.layers.append(layer)
    return cache
