"""Gradients a ``.data`` replacement left at the old size do not stop a capture
(capture/stale_gradients.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.capture.stale_gradients import stale_gradients_set_aside


def test_stale_gradients_are_set_aside_and_put_back() -> None:
    p = nn.Parameter(torch.randn(3, 2))
    p.grad = torch.ones(3, 2)
    stale = p.grad
    fresh = nn.Parameter(torch.randn(4))
    fresh.grad = torch.full((4,), 2.0)
    p.data = torch.randn(5, 2)  # grown: its gradient is the old size
    with stale_gradients_set_aside([p, fresh]):
        assert p.grad is None
        assert fresh.grad is not None  # a gradient of the right size stays
    assert p.grad is stale and p.shape == (5, 2) and p.grad.shape == (3, 2)
    p.grad = None  # what zero_grad() does: works as in eager
    assert p.grad is None


class _Grown(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).square().mean()


def _grow(model: nn.Module) -> None:
    """Two more hidden units, copied from the first two (a Net2Net-style widening)."""
    with torch.no_grad():
        model.a.weight.data = torch.cat([model.a.weight.data, model.a.weight.data[:2]])
        model.a.bias.data = torch.cat([model.a.bias.data, model.a.bias.data[:2]])
        model.b.weight.data = torch.cat([model.b.weight.data, model.b.weight.data[:, :2] * 0.5], 1)


def test_a_layer_widened_through_data_trains_in_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 27: the capture after the widening failed on the old-size gradients (zero_grad()
    comes after the forward in this loop) and the model went to PyTorch for good."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # nothing may go to PyTorch
    torch.manual_seed(0)
    eager = _Grown()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step in range(4):
        if step == 2:
            _grow(eager)
            _grow(wrapped.module)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        losses = []
        for model in (eager, wrapped):
            loss = model(x)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), f"step {step}"
    for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert wrapped.a.weight.shape == (8, 6)
