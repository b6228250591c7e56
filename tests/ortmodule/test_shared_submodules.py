"""A submodule registered under two names keeps its parameters through a capture
(ortrain/capture/shared_submodules.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn


class _SharedBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.blocks = nn.Sequential(*[block] * 3)  # one block, three names
        self.head = nn.Linear(8, 1)
        self.alias = self.head  # and a head under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alias(self.blocks(x)).square().mean()


def test_weight_shared_blocks_train_whole_on_onnxruntime(monkeypatch, caplog) -> None:
    """Until wave 42 the capture left the block holding traced values: the step ran in PyTorch, and
    the next capture took the model for one its forward changes, with a warning, for good."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = _SharedBlocks()
    batches = [torch.randn(n, 8) for n in (6, 4, 7, 5)]
    with caplog.at_level(logging.INFO, logger="ortrain"):
        losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x))
    assert losses_ort == pytest.approx(losses_eager, rel=1e-5)
    assert_same_state(wrapped.module, eager)
    assert not [r for r in caplog.records if "changed the model" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert ort_graph_count(wrapped) == 2  # the first size, then the dynamic one
    weight = wrapped.module.blocks[0][0].weight
    assert isinstance(weight, nn.Parameter) and wrapped.module.blocks[2][0].weight is weight


class _SharedBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)
        norm = nn.BatchNorm1d(8)
        self.norm_a = norm
        self.norm_b = norm  # buffers it writes, under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm_a(self.linear(x)))
        return self.norm_b(h + 1).square().mean()


def test_a_batch_norm_under_two_names_trains_whole(monkeypatch) -> None:
    """AOTAutograd's metadata holds each tensor once: read against every name, the capture failed
    ("zip() argument 2 is shorter than argument 1") once wave 42's first fix let it get there."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    batches = [torch.randn(n, 6) for n in (5, 7, 4)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        _SharedBatchNorm(), batches, lambda m, x: m(x)
    )
    assert losses_ort == pytest.approx(losses_eager, rel=1e-5)
    assert_same_state(wrapped.module, eager)
    assert wrapped._ortrain_graph_breaks is None
