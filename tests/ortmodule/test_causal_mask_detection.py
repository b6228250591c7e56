"""``nn.Transformer`` and ``nn.TransformerEncoder`` called with a causal mask and no ``is_causal``
are captured whole (ortrain/capture/causal_mask_detection.py)."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn

WIDTH = 8


class _Encoder(nn.Module):
    def __init__(self, is_causal: bool | None) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.is_causal = is_causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.encoder(x, mask=mask, is_causal=self.is_causal).square().mean()


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(WIDTH, 2, 1, 1, 16, dropout=0.0, batch_first=True)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1], dtype=target.dtype)
        return self.transformer(source, target, tgt_mask=mask).square().mean()


@pytest.mark.parametrize("is_causal", [None, True, False], ids=str)
def test_an_encoder_given_a_mask_trains_as_one_graph(is_causal: bool | None) -> None:
    """Until wave 42, without ``is_causal`` PyTorch's check of the mask's values split the model at
    graph breaks, and its layers ran in eager PyTorch without a word."""
    torch.manual_seed(0)
    batches = [torch.randn(4, 5, WIDTH) for _ in range(2)]  # one graph: what the test is about
    model = _Encoder(is_causal)
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x))
    assert losses_ort == pytest.approx(losses_eager, rel=1e-5)
    assert_same_state(wrapped.module, eager)
    assert wrapped._ortrain_graph_breaks is None
    assert ort_graph_count(wrapped) == 1  # whole in ONNX Runtime


def test_a_transformer_given_a_target_mask_trains_as_one_graph() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(4, 6, WIDTH), torch.randn(4, 5, WIDTH)) for _ in range(2)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(_Seq2Seq(), batches, lambda m, b: m(*b))
    assert losses_ort == pytest.approx(losses_eager, rel=1e-5)
    assert_same_state(wrapped.module, eager)
    assert wrapped._ortrain_graph_breaks is None
