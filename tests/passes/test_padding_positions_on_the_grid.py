"""Padding elimination takes position embeddings that lie on the padded stream's (batch, seq) grid
as that stream's, and declines where no linear or matmul would run on real tokens.

Wave 54's review: RoBERTa's position embedding (padding_idx=1, looked up with position ids computed
from the same input ids) was taken for another padded stream, so only 1 op moved and the rest ran
dense after a re-pad; a ``nn.Parameter(T, D)`` position table made the pass skip the embedding
(only ``[1, T, D]`` was accepted); and a pass that moved only cheap ops before the next re-pad cost
a zero fill and an index_copy for nothing. Each model runs rewritten in float64 against itself.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _padding_parity import PAD, D, V, eliminate_and_compare, padded
from torch import nn
from torch.nn import functional as F

T = 6
MOVED = "padding elimination: {} token-wise ops after embedding run on real tokens only"


def _roberta_position_ids(ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """transformers' ``create_position_ids_from_input_ids``: pads get padding_idx, real tokens count on."""
    mask = ids.ne(padding_idx).int()
    incremental = (torch.cumsum(mask, dim=1).type_as(mask) + 0) * mask
    return incremental.long() + padding_idx


class _RobertaStyle(nn.Module):
    """Word and position embeddings (both with a padding_idx), layer norm, an MLP and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(V, D, padding_idx=PAD)
        self.positions = nn.Embedding(T + 2, D, padding_idx=1)
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.words(ids) + self.positions(_roberta_position_ids(ids, PAD)))
        x = x + self.down(torch.tanh(self.up(x)))
        return F.cross_entropy(F.linear(x, self.words.weight).reshape(-1, V), labels.reshape(-1))


@pytest.mark.parametrize("shape", [(4, T), (T, T)], ids=["batch!=seq", "batch==seq"])
def test_roberta_position_ids_are_the_streams_own(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    ids, labels = padded(*shape, seed=5)
    changes = eliminate_and_compare(_RobertaStyle(), [ids, labels])
    # add, layer norm, both linears, tanh, residual add, the head and its reshape: none left dense
    assert changes == [MOVED.format(8)], changes


class _PositionTable(nn.Module):
    """Position embeddings as a ``[T, D]`` parameter, broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(V, D, padding_idx=PAD)
        self.positions = nn.Parameter(torch.randn(T, D))
        self.hidden, self.head = nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.words(ids) + self.positions
        return F.cross_entropy(self.head(torch.relu(self.hidden(x))).reshape(-1, V), labels.reshape(-1))


def test_a_seq_by_features_position_table_moves() -> None:
    torch.manual_seed(0)
    ids, labels = padded(4, T, seed=6)
    changes = eliminate_and_compare(_PositionTable(), [ids, labels])
    assert changes == [MOVED.format(5)], changes


class _CheapThenSeqFirst(nn.Module):
    """Only a layer norm on (batch, seq) rows, then everything in seq-first order (as
    nn.MultiheadAttention lays a batch-first input out): nothing heavy could run on real tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(V, D, padding_idx=PAD)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq_first = self.norm(self.words(ids)).transpose(0, 1)
        return F.cross_entropy(self.head(seq_first).reshape(-1, V), labels.t().reshape(-1))


def test_only_cheap_ops_to_move_declines(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    ids, labels = padded(4, T, seed=7)
    with caplog.at_level(logging.INFO, logger="ortrain.passes"):
        changes = eliminate_and_compare(_CheapThenSeqFirst(), [ids, labels])
    assert changes == []
    declined = (
        "padding elimination: embedding skipped (the 1 token-wise ops that could run on real tokens include "
        "no linear or matmul: gathering and re-padding them would cost more than it saves)"
    )
    assert declined in caplog.text
