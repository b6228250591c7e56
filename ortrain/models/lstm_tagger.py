"""A sequence tagger: token embedding, a stacked LSTM, a linear head per token."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class LSTMTagger(nn.Module):
    """``model(tokens, tags)`` returns the cross-entropy of the tag logits over every position."""

    def __init__(self, vocab: int = 1000, width: int = 256, layers: int = 2, tags: int = 20) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width // 2)
        self.rnn = nn.LSTM(width // 2, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, tags)

    def forward(self, tokens: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        states = self.rnn(self.embedding(tokens))[0]
        return F.cross_entropy(self.head(states).flatten(0, 1), tags.flatten())
