"""Calls of a wrapped model inside ``torch.nn.utils.parametrize.cached()`` behave as in eager."""

from __future__ import annotations

import copy

import pytest
import torch
from _parity import assert_same_state
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from ortrain import ORTModule


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(parametrizations.spectral_norm(nn.Linear(6, 8)), nn.ReLU(), nn.Linear(8, 3))


def _two_calls_in_one_block(module: nn.Module, x0: torch.Tensor, x1: torch.Tensor) -> float:
    module.zero_grad()
    with parametrize.cached():
        loss = module(x0).square().mean() + module(x1).square().mean()
    loss.backward()
    return loss.item()


def test_two_calls_in_one_cached_block_compute_the_parametrization_once() -> None:
    """Wave 15: the captured graph ran spectral norm's power iteration at each call, where eager
    runs it once per block: ``_u``/``_v`` and the weight's gradient differed, silently."""
    model = _model()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x0, x1 = torch.randn(5, 6), torch.randn(5, 6)
    for module in (wrapped, eager):  # an ordinary step first: the graph exists
        module(x0).sum().backward()
    assert _two_calls_in_one_block(wrapped, x0, x1) == pytest.approx(
        _two_calls_in_one_block(eager, x0, x1), rel=1e-6
    )
    assert_same_state(wrapped, eager, atol=1e-7)
    for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    # Outside the block, the graph runs again.
    for module in (wrapped, eager):
        module(x1).sum().backward()
    assert_same_state(wrapped, eager, atol=1e-6)


def test_a_first_call_inside_a_cached_block() -> None:
    """Capturing inside the block left a traced weight in the cache: the next call failed."""
    model = _model()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x0, x1 = torch.randn(5, 6), torch.randn(5, 6)
    assert _two_calls_in_one_block(wrapped, x0, x1) == pytest.approx(
        _two_calls_in_one_block(eager, x0, x1), rel=1e-6
    )
    assert_same_state(wrapped, eager, atol=1e-7)
