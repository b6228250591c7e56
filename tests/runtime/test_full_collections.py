"""No automatic full collection while compiling; the one that fell due runs at the end."""

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


def test_young_collections_go_on_the_full_one_waits_for_the_end(thresholds: tuple[int, int, int]) -> None:
    gc.collect()
    before = _full_collections()
    with full_collections_deferred():
        assert gc.get_threshold()[:2] == thresholds[:2]
        for _ in range(3 * thresholds[2]):
            gc.collect(1)  # each counts towards the oldest generation's threshold
        assert _full_collections() == before
        with full_collections_deferred():  # a nested compile changes nothing
            pass
        assert gc.get_threshold()[2] > thresholds[2]
    assert gc.get_threshold() == thresholds
    assert _full_collections() == before + 1  # the one that fell due


def test_nothing_due_nothing_collected(thresholds: tuple[int, int, int]) -> None:
    gc.collect()
    before = _full_collections()
    with full_collections_deferred():
        gc.collect()  # ortrain's own collection after export resets the count
    assert _full_collections() == before + 1
    assert gc.get_threshold() == thresholds


def test_a_disabled_collector_stays_idle(thresholds: tuple[int, int, int]) -> None:
    gc.disable()
    try:
        before = _full_collections()
        with full_collections_deferred():
            for _ in range(3 * thresholds[2]):
                gc.collect(1)
        assert _full_collections() == before and not gc.isenabled()
    finally:
        gc.enable()


def test_first_step_restores_the_thresholds() -> None:
    before = gc.get_threshold()
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    model(torch.randn(2, 4)).sum().backward()
    assert gc.get_threshold() == before
    assert all(p.grad is not None for p in model.parameters())
