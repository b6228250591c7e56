"""Hugging Face caches returned by (and passed to) a wrapped model keep their whole state."""

from __future__ import annotations

import copy

import torch
from transformers import MistralConfig, MistralForCausalLM, WhisperConfig, WhisperForConditionalGeneration

from ortrain import ORTModule


def _cache(output: object) -> object:
    return output["cache"] if "cache" in output else output["past_key_values"]  # type: ignore[index]


def test_a_sliding_window_cache_comes_back_with_its_token_count() -> None:
    """transformers' pytree form keeps keys and values only: a sliding-window layer's count of the
    tokens it has seen came back reset (3 where eager says 10), and decoding from that cache went
    on at wrong positions; training a sliding-window model returns such a cache too."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, max_position_embeddings=64,
    )  # fmt: skip
    eager = MistralForCausalLM(config).eval()
    wrapped = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        got, want = _cache(wrapped(input_ids=ids)), _cache(eager(input_ids=ids))
        assert got.get_seq_length() == want.get_seq_length() == 10  # type: ignore[attr-defined]
        after = torch.randint(0, 100, (2, 1))
        torch.testing.assert_close(
            eager(input_ids=after, past_key_values=got).logits,
            eager(input_ids=after, past_key_values=want).logits,
        )
    wrapped.train()
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, eager.train()(input_ids=ids, labels=ids).loss)


def test_an_encoder_decoder_cache_output_trains_in_onnxruntime() -> None:
    """Whisper returns an EncoderDecoderCache even with labels; it could not leave the graph, and
    the model was refused (FALLBACK_DISABLE) or trained in PyTorch."""
    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16, max_target_positions=16, decoder_start_token_id=1, pad_token_id=0,
    )  # fmt: skip
    eager = WhisperForConditionalGeneration(config)
    wrapped = ORTModule(copy.deepcopy(eager))
    features, labels = torch.randn(2, 8, 32), torch.randint(2, 64, (2, 6))
    got, want = wrapped(input_features=features, labels=labels), eager(input_features=features, labels=labels)
    torch.testing.assert_close(got.loss, want.loss)
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
