"""The zoo: each model trains 5 steps under ORTModule and in eager PyTorch with the same results."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn
from torch.nn import functional as F

from ortrain.models.tiny_gpt import GPTConfig, TinyGPT

STEPS = 5


def _assert_parity(model: nn.Module, batches: list, loss_fn, max_captures: int = 2) -> None:
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, loss_fn)
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=0)
    assert_same_state(wrapped, eager)
    assert 1 <= ort_graph_count(wrapped) <= max_captures


def test_mlp() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    batches = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(STEPS)]
    _assert_parity(model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), max_captures=1)


def test_cnn_with_batchnorm_pooling_and_grouped_strided_conv() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2, groups=2, dilation=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=2, dilation=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 5),
    )
    batches = [(torch.randn(4, 3, 17, 17), torch.randint(0, 5, (4,))) for _ in range(STEPS)]
    _assert_parity(model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), max_captures=1)


@pytest.mark.parametrize("attention", ["sdpa", "softmax"])
def test_tiny_gpt_with_ignore_index_and_changing_lengths(attention: str) -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, d_model=32, attention=attention)
    batches = []
    for step in range(STEPS):
        length = 12 + 3 * step
        idx = torch.randint(0, 97, (3, length))
        targets = torch.randint(0, 97, (3, length))
        targets[:, :4] = -100  # e.g. a prompt that is not trained on
        batches.append((idx, targets))
    _assert_parity(TinyGPT(config), batches, lambda m, b: m(b[0], b[1])[1])


def test_hf_gpt2_lm_head() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    batches = [torch.randint(0, 101, (2, 10 + step)) for step in range(STEPS)]
    _assert_parity(model, batches, lambda m, b: m(input_ids=b, labels=b).loss)


def test_hf_llama_made_bidirectional_attends_both_ways() -> None:
    """``self_attn.is_causal = False`` on every layer (LLM2Vec's bidirectional decoder), batches
    without a mask: eager builds no mask and each layer's flag applies. Until wave 41 the capture
    made Hugging Face build a causal mask anyway, and the model trained causal (loss 4.834 where
    eager gave 4.841). Grouped key-value heads: the attention runs in ONNX Runtime's math form."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    batches = [torch.randint(1, 128, (2, 10)) for _ in range(STEPS)]
    _assert_parity(model, batches, lambda m, b: m(input_ids=b, labels=b).loss, max_captures=1)


def test_hf_bert_sequence_classification_with_padding_mask() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    batches = []
    for step in range(STEPS):
        ids = torch.randint(0, 101, (2, 9 + step))
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (2,))})
    _assert_parity(model, batches, lambda m, b: m(**b).loss)


def test_dropout_mask_is_the_same_in_forward_and_backward() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 1.5, 64))
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(x * self.w)

    from ortrain import ORTModule

    model = ORTModule(Scaled())
    x = torch.rand(32, 64) + 0.5  # never 0, so a zero output means "dropped"
    y = model(x)
    y.sum().backward()
    kept = y != 0
    assert 0.35 < kept.float().mean().item() < 0.65
    # Kept elements were scaled by 1 / (1 - p) in forward; backward must use the same mask.
    torch.testing.assert_close(y[kept], (x * model.w.detach() * 2)[kept])
    torch.testing.assert_close(model.w.grad, (kept * x * 2).sum(0))
