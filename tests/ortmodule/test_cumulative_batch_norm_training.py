"""A model with BatchNorm(momentum=None), and SWA's update_bn (which sets it), trains on one graph."""

from __future__ import annotations

import copy

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

from ortrain import ORTModule


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Linear(16, 2))


def test_training_with_cumulative_averages_runs_one_graph_like_eager() -> None:
    """``1.0 / float(num_batches_tracked)`` cannot be traced: such a model went through TorchDynamo,
    which warned of a graph break and recompiled at every step."""
    torch.manual_seed(0)
    batches = [(torch.randn(16, 8), torch.randint(0, 2, (16,))) for _ in range(4)]
    losses, expected, eager, wrapped = train_side_by_side(
        _classifier(), batches, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    assert_same_state(wrapped, eager, atol=1e-5)
    assert wrapped._ortrain_graph_breaks is None and ort_graph_count(wrapped) == 1


def test_cumulative_averages_at_new_batch_sizes_run_in_onnx_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dynamic capture's unbiased variance divided a float64 sum by a float32 ``n - 1`` in
    ONNX (torch.onnx's ``var_mean``): until wave 43 the layer ran in PyTorch from the second batch
    size on, and FALLBACK_DISABLE refused the model."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    batches = [(torch.randn(n, 8), torch.randint(0, 2, (n,))) for n in (16, 9, 12, 5)]
    losses, expected, eager, wrapped = train_side_by_side(
        _classifier(), batches, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    assert_same_state(wrapped, eager, atol=1e-5)


def test_swa_update_bn_on_a_wrapped_model_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    inputs = [torch.randn(16, 8) for _ in range(3)]
    averaged = {}
    for wrap in (False, True):
        swa = AveragedModel(ORTModule(copy.deepcopy(model)) if wrap else copy.deepcopy(model))
        update_bn(inputs, swa)  # momentum None while it runs, restored after
        averaged[wrap] = swa
    assert_same_state(averaged[True], averaged[False], atol=1e-6)
    assert averaged[True].module._ortrain_graph_breaks is None
