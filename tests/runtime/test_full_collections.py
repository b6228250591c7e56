"""No automatic full collection while compiling; the thresholds come back after it."""

from __future__ import annotations

import gc

import pytest
import torch

from ortrain import ORTModule
from ortrain.runtime.full_collections import full_collections_deferred


def _full_collections() -> int:
    return gc.get_stats()[-1]["collections"]


@pytest.fixture
def thresholds() -> tuple[int, int, int]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield gc.get_threshold()
    gc.set_threshold(*before)


def test_only_the_oldest_generation_waits(thresholds: tuple[int, int, int]) -> None:
    with full_collections_deferred():
        young, full = gc.get_threshold()[:2], gc.get_threshold()[2]
        assert young == thresholds[:2]  # collected as usual
        assert full > 1_000_000  # never reached by a compile's young collections
        with full_collections_deferred():  # a nested compile changes nothing
            pass
        assert gc.get_threshold()[2] == full
    assert gc.get_threshold() == thresholds


def test_explicit_collections_still_run(thresholds: tuple[int, int, int]) -> None:
    before = _full_collections()
    with full_collections_deferred():
        gc.collect()  # ortrain's own collection after export
    assert _full_collections() == before + 1
    assert gc.get_threshold() == thresholds


def test_first_step_restores_the_thresholds() -> None:
    before = gc.get_threshold()
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    model(torch.randn(2, 4)).sum().backward()
    assert gc.get_threshold() == before
    assert all(p.grad is not None for p in model.parameters())
