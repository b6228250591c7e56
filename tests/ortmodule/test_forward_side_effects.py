"""A forward that changes the model: capture leaves no trace of itself, and the change happens
as often as it does eagerly (ortrain/ortmodule/module_snapshot.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from _parity import assert_same_state
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ortrain import ORTModule


def _step(module: nn.Module, x: torch.Tensor) -> float:
    module.zero_grad(set_to_none=True)
    loss = module(x)
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
    return loss.item()


class _RotaryCache(nn.Module):
    """Fills a position table on first use and grows it for longer sequences, as rotary
    embeddings of several Hugging Face models did (``self.cos_cached``, ``max_seq_len_cached``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.cached_length = 0
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length > self.cached_length:
            self.table = torch.arange(length, dtype=x.dtype) / 10
            self.cached_length = length
        assert self.table is not None
        return (self.proj(x) * self.table[:length, None]).square().mean()


def test_a_cache_filled_on_first_use_trains_as_eager_and_is_left_real(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Capture traces on fake tensors: the table it filled was left in the model, and every later
    step failed on it ("Mixing fake modes"). Now the step whose capture changed the model runs in
    PyTorch, and the next captures the model as that step left it."""
    eager = _RotaryCache()
    wrapped = ORTModule(copy.deepcopy(eager))
    torch.manual_seed(1)
    with caplog.at_level(logging.INFO, logger="ortrain.ortmodule"):
        for length in (8, 8, 16, 8, 12, 12):
            x = torch.randn(2, length, 4)
            assert _step(wrapped, x) == pytest.approx(_step(eager, x), rel=1e-5)
            assert_same_state(wrapped, eager)
    inner = wrapped._ortrain_module
    assert inner.cached_length == 16 and not isinstance(inner.table, FakeTensor)
    assert "attribute 'table' of the model was changed" in caplog.text
    assert wrapped._ortrain_graph_breaks is None  # the captured graphs train the later steps
    assert len(wrapped._ortrain_graphs) >= 2


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x).square().mean()


def test_a_change_at_every_call_happens_at_every_call(caplog: pytest.LogCaptureFixture) -> None:
    """A captured graph never runs the forward's Python: the counter counted captures (three
    traces each) and each step captured again. Such a model now trains through TorchDynamo's
    graph breaks, which replay the change, after one warning naming it."""
    eager = _Counter()
    wrapped = ORTModule(copy.deepcopy(eager))
    torch.manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="ortrain.ortmodule"):
        for _ in range(4):
            x = torch.randn(3, 4)
            assert _step(wrapped, x) == pytest.approx(_step(eager, x), rel=1e-5)
    assert wrapped._ortrain_module.calls == eager.calls == 4
    assert_same_state(wrapped, eager)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "attribute 'calls' of the model" in warnings[0]


def test_a_lazy_layer_is_initialized_by_a_real_step() -> None:
    """``nn.LazyLinear`` makes its parameters in its first forward: traced, they were fake."""

    def lazy_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 2))

    model, eager = lazy_model(), lazy_model()
    wrapped = ORTModule(model)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 6)
        losses = []
        for module in (wrapped, eager):
            module.zero_grad(set_to_none=True)
            torch.manual_seed(2)  # the lazy layer draws its initial weights in its first forward
            loss = module(x).square().mean()
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert model[0].weight.shape == (8, 6)
    assert len(wrapped._ortrain_graphs) == 1  # steps 2 and 3 ran a captured graph
    assert not any(isinstance(p, FakeTensor) for p in model.parameters())
    assert_same_state(wrapped, eager)
