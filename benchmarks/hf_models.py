"""Tiny Hugging Face models for ``bench_ortmodule.py --models benchmarks.hf_models:NAME``.

Each factory returns ``(model, batch)`` the way ``ortrain.bench`` takes a model of one's own: the
model returns a ``ModelOutput`` whose ``loss`` the benchmark trains on. Sizes are the ones the
README's measurements use: vocabulary 2000, width 256, 4 layers (T5: 3 + 3), batch 8 × 128
tokens, no dropout, random weights and tokens (seeded by the benchmark). Run from the repository
root (the children import this file as ``benchmarks.hf_models``); needs ``transformers`` (the
``dev`` or ``transformers`` extra)::

    python benchmarks/bench_ortmodule.py --repeats 3 --competitors eager,compile,ortrain \\
        --models benchmarks.hf_models:t5,benchmarks.hf_models:llama,benchmarks.hf_models:bloom
"""

from __future__ import annotations

import torch
from torch import nn

_VOCAB, _WIDTH, _BATCH, _SEQ = 2000, 256, 8, 128


def _tokens(length: int = _SEQ) -> torch.Tensor:
    return torch.randint(0, _VOCAB, (_BATCH, length))


def t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """T5 with its ReLU feed-forward and RMS norms (relative position buckets, safe softmax)."""
    import transformers

    config = transformers.T5Config(
        vocab_size=_VOCAB, d_model=_WIDTH, d_kv=32, d_ff=4 * _WIDTH, num_layers=3, num_decoder_layers=3,
        num_heads=8, dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    batch = {"input_ids": _tokens(), "labels": _tokens(_SEQ // 2)}
    return transformers.T5ForConditionalGeneration(config), batch


def llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Llama: RMS norms, SiLU gates, rotary embeddings (rotate_half's slices), grouped queries."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=_VOCAB, hidden_size=_WIDTH, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2 * _SEQ,
    )  # fmt: skip
    ids = _tokens()
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def bloom() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """BLOOM: ALiBi, a fused query-key-value projection split by select."""
    import transformers

    config = transformers.BloomConfig(
        vocab_size=_VOCAB, hidden_size=_WIDTH, n_layer=4, n_head=8, hidden_dropout=0.0, attention_dropout=0.0
    )
    ids = _tokens()
    return transformers.BloomForCausalLM(config), {"input_ids": ids, "labels": ids}
