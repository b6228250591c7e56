"""Boolean-mask assignments in a forward: ``h[mask] = row`` (SpecAugment, a mask token) is captured
whole and runs in ONNX Runtime; ``h[mask] = f(h[mask])``, which TorchDynamo splits and whose
backward ortrain cannot capture, trains in PyTorch with one warning of ortrain's instead of pages
of TorchDynamo's and anomaly mode's."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn

from ortrain import ORTModule


class MaskedTimeSteps(nn.Module):
    """Wav2Vec2's SpecAugment: masked time steps take a learned vector (or a learned scalar)."""

    def __init__(self, shape: tuple[int, ...] = (4,)) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.masked_embed = nn.Parameter(torch.randn(shape))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h[mask] = self.masked_embed.to(h.dtype)
        return self.head(torch.tanh(h)).pow(2).mean()


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    masks = [torch.rand(2, 5, generator=g) > 0.5 for _ in range(count - 2)]
    masks += [torch.zeros(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool)]
    return [(torch.randn(2, 5, 4, generator=g), mask) for mask in masks]


@pytest.mark.parametrize("shape", [(4,), ()], ids=["vector", "scalar"])
def test_a_learned_value_assigned_through_a_mask_trains_in_onnxruntime(shape: tuple[int, ...]) -> None:
    """A learned scalar's gradient went through a ``nonzero`` until wave 45: the model ran in
    PyTorch (refused under FALLBACK_DISABLE, which the tests run under)."""
    torch.manual_seed(0)
    model = MaskedTimeSteps(shape)
    losses, expected, eager, wrapped = train_side_by_side(model, _batches(5), lambda m, b: m(*b))
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert_same_state(eager, wrapped.module)
    assert wrapped._ortrain_graph_breaks is None  # one whole graph, no TorchDynamo
    assert ort_graph_count(wrapped) == 1


class SelectedTokensProjected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.selected = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h[mask] = self.selected(h[mask])
        return h.pow(2).sum()


def test_rows_assigned_one_each_train_in_pytorch_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default policy: under FALLBACK_DISABLE such a region is an error since wave 42
    # (tests/ortmodule/test_graph_breaks.py).
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    eager = SelectedTokensProjected()
    wrapped = ORTModule(copy.deepcopy(eager))
    torch._dynamo.reset()
    try:
        with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            for x, mask in _batches(3):
                wrapped(x, mask).backward()
                eager(x, mask).backward()
    finally:
        torch._dynamo.reset()
    for ours, theirs in zip(wrapped.module.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    eager_code = [m for m in warned if "which therefore runs in eager PyTorch" in m]
    assert len(eager_code) == 1 and "`h[mask] = self.selected(h[mask])`" in eager_code[0]
    assert "aten.nonzero" in eager_code[0]
    assert not [m for m in warned if "Backend compiler exception" in m]  # TorchDynamo's page
    assert not [w for w in shown if "Error detected in" in str(w.message)]  # anomaly mode's
