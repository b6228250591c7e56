"""Dropout follows torch.manual_seed: the same seed trains the same run again, other seeds other masks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ortrain import ORTModule


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # one placement: the linear layers in ONNX Runtime


def _train(seed: int) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = ORTModule(nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    torch.manual_seed(seed)
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    graphs = [runner for _, runner in model.graph_runners()]
    assert graphs, "nothing ran in ONNX Runtime"
    return losses, [p.detach().clone() for p in model.parameters()]


def test_same_seed_same_run_other_seed_other_masks() -> None:
    first, again, other = _train(1), _train(1), _train(2)
    assert first[0] == again[0]
    assert all(torch.equal(a, b) for a, b in zip(first[1], again[1], strict=True))
    assert first[0] != other[0]


def test_steps_draw_new_masks() -> None:
    torch.manual_seed(0)
    model = ORTModule(nn.Dropout(0.5))
    x = torch.ones(1000, requires_grad=True)
    first, second = model(x), model(x)
    assert not torch.equal(first, second)
    assert 0.4 < (first == 0).float().mean().item() < 0.6


class _Noisy(nn.Module):
    """Random numbers besides dropout: noise injection, a random mask, a drawn index."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.linear(x)
        noisy = h + 0.1 * torch.randn_like(h)
        keep = torch.bernoulli(torch.full_like(h, 0.8))
        return (noisy * keep).square().mean(), keep, torch.rand(h.shape), torch.randint(0, 10, (4,))


def test_other_random_ops_follow_the_seed_and_their_distribution() -> None:
    """ONNX Runtime's RandomNormalLike and RandomUniformLike drew other numbers under the same seed
    (seeded when the session was made), and its Bernoulli kernel kept 1 - p: a mean of 0.2 for
    p = 0.8. Drawn by PyTorch, they follow the seed, and the values are eager's own."""
    torch.manual_seed(0)
    eager = _Noisy()
    wrapped = ORTModule(_Noisy())
    wrapped.load_state_dict(eager.state_dict())
    x = torch.randn(64, 16)
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        expected = eager(x)
        torch.manual_seed(seed)
        got = wrapped(x)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)
        assert 0.75 < got[1].mean().item() < 0.85
    assert any(True for _ in wrapped.graph_runners())
