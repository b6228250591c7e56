"""Padding elimination gathers a dense tensor's real tokens only where data flow shows its rows are
the padded stream's (batch, seq) tokens, in that order; a matching shape is not enough.

Wave 54's review: a decoder sharing the encoder's padded embedding was gathered at the encoder's
real tokens (same (B, T) shape), a seq-first ``transpose(0, 1).reshape(-1, D)`` at the flat
``(b, t)`` index, and a ``(T, B, D)`` tensor passed for ``(B, T, D)`` when B == T: losses 1-35 %
and gradients 40-110 % off, silently. Each test runs the rewritten graph eagerly in float64 and
compares the loss and every gradient with the model's.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from _padding_parity import PAD, D, V, eliminate_and_compare, padded
from torch import nn
from torch.nn import functional as F


class _Block(nn.Module):
    """Masked self-attention and an MLP, pre-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).split(D, -1)
        scores = q @ k.transpose(1, 2) / math.sqrt(D) + (~mask[:, None, :]).to(x.dtype) * -1e9
        x = x + self.out(scores.softmax(-1) @ v)
        return x + self.mlp(x)


class _SharedEmbeddingEncoderDecoder(nn.Module):
    """One padded embedding for source and target; the encoder reaches the decoder through a
    masked mean (``mean``) or added position by position (``add``, same lengths; masked, so the
    decoder reads zeros where the source has pads, in eager too)."""

    def __init__(self, bridge: str) -> None:
        super().__init__()
        self.bridge = bridge
        self.embedding = nn.Embedding(V, D, padding_idx=PAD)
        self.encoder, self.decoder = _Block(), _Block()
        self.mix = nn.Linear(D, D, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        src_mask, tgt_mask = src != PAD, tgt != PAD
        encoded = self.encoder(self.embedding(src), src_mask)
        if self.bridge == "mean":
            counts = src_mask.sum(1, keepdim=True).clamp(min=1).unsqueeze(-1)
            bridge = (encoded * src_mask.unsqueeze(-1)).sum(1, keepdim=True) / counts
        else:
            bridge = encoded * src_mask.unsqueeze(-1)
        decoded = self.decoder(self.embedding(tgt) + self.mix(bridge), tgt_mask)
        logits = F.linear(decoded, self.embedding.weight)
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


@pytest.mark.parametrize("bridge", ["mean", "add"])
def test_a_decoder_sharing_the_padded_embedding_keeps_its_own_tokens(bridge: str) -> None:
    torch.manual_seed(0)
    src, _ = padded(4, 8, seed=1)
    tgt, labels = padded(4, 8, seed=2)  # same shape as src, pads elsewhere
    assert not torch.equal(src == PAD, tgt == PAD)
    changes = eliminate_and_compare(_SharedEmbeddingEncoderDecoder(bridge), [src, tgt, labels])
    assert any(c.startswith("padding elimination: ") for c in changes), changes  # the encoder still is


class _SeqFirstFlat(nn.Module):
    """fairseq's layout: (T, B, D) flattened to (T * B, D) rows, labels in the same order."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, D, padding_idx=PAD)
        self.hidden, self.head = nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = self.embedding(ids).transpose(0, 1).reshape(-1, D)
        logits = self.head(torch.relu(self.hidden(rows)))
        return F.cross_entropy(logits, labels.t().reshape(-1))


def test_seq_first_flattened_rows_are_left_dense(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    ids, labels = padded(4, 6, seed=3)
    with caplog.at_level(logging.INFO, logger="ortrain.passes"):
        changes = eliminate_and_compare(_SeqFirstFlat(), [ids, labels])
    assert changes == []
    skipped = "padding elimination: embedding skipped (no token-wise op reads its rows in (batch, seq) order)"
    assert skipped in caplog.text


class _SeqFirst(nn.Module):
    """nn.Transformer(batch_first=False)'s layout: a token-wise layer on (T, B, D), then back."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, D, padding_idx=PAD)
        self.first, self.second, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq_first = self.first(self.embedding(ids)).transpose(0, 1)
        batch_first = torch.relu(self.second(seq_first)).transpose(0, 1)
        return F.cross_entropy(self.head(batch_first).reshape(-1, V), labels.reshape(-1))


@pytest.mark.parametrize("shape", [(5, 5), (4, 6)], ids=["batch==seq", "batch!=seq"])
def test_seq_first_layer_is_not_taken_for_batch_first(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    ids, labels = padded(*shape, seed=4)
    changes = eliminate_and_compare(_SeqFirst(), [ids, labels])
    # the first layer and the head (back in (batch, seq) order) still run on real tokens
    moved = "padding elimination: 3 token-wise ops after embedding run on real tokens only"
    assert changes == [moved], changes
