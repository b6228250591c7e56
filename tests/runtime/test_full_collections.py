"""No automatic full collection while compiling; the thresholds come back after it; the compile's
own collection walks the objects made during it only."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from ortrain import ORTModule
from ortrain.runtime.full_collections import collect_compile_garbage, full_collections_deferred


def _full_collections() -> int:
    return gc.get_stats()[-1]["collections"]


@pytest.fixture
def thresholds() -> tuple[int, int, int]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield gc.get_threshold()
    gc.set_threshold(*before)


@pytest.fixture
def no_automatic_collections() -> None:
    """Garbage made on purpose stays until the test collects it."""
    gc.disable()
    yield
    gc.enable()


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


def test_first_step_restores_the_thresholds(no_automatic_collections: None) -> None:
    before = gc.get_threshold()
    gc.collect()
    lost = _cycle()
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    model(torch.randn(2, 4)).sum().backward()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert all(p.grad is not None for p in model.parameters())
    assert lost() is not None  # the compile collected its own garbage, not the process's


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_compiles_collection_walks_its_own_objects_only(
    thresholds: tuple[int, int, int], no_automatic_collections: None
) -> None:
    gc.collect()
    older = _cycle()  # garbage from before the compile: Python's next full collection takes it
    tracked_before = len(gc.get_objects())
    with full_collections_deferred():
        assert gc.get_freeze_count() >= tracked_before  # the process's objects are not walked
        made = _cycle()
        assert collect_compile_garbage() >= 2
        assert made() is None  # the compile's garbage is gone
        assert older() is not None
    assert gc.get_freeze_count() == 0  # nothing stays frozen
    gc.collect()
    assert older() is None


def test_objects_the_user_froze_stay_frozen(
    thresholds: tuple[int, int, int], no_automatic_collections: None
) -> None:
    gc.collect()
    gc.freeze()  # as servers do before forking
    try:
        frozen = gc.get_freeze_count()

        def still_frozen_alone() -> bool:
            # A frozen object can die meanwhile (another thread drops its last reference: the
            # count fell by 2 in one CI run); ortrain unfreezing would drop it to zero, freezing
            # more would raise it.
            return 0.99 * frozen <= gc.get_freeze_count() <= frozen

        with full_collections_deferred():
            assert still_frozen_alone()  # ortrain freezes nothing more
            made = _cycle()
            collect_compile_garbage()
            assert made() is None
        assert still_frozen_alone()
    finally:
        gc.unfreeze()


def test_the_compile_backend_collects_the_compiles_garbage_only(compile_collections: list[bool]) -> None:
    import ortrain.backend

    frozen_at_collection = compile_collections
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    try:
        x = torch.randn(2, 4)
        torch.compile(model, backend=ortrain.backend.OrtrainBackend())(x).sum().backward()
    finally:
        torch._dynamo.reset()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    # The forward graph, the whole compile around it, then the backward graph at the backward.
    assert frozen_at_collection == [True, True, True]
    assert gc.get_freeze_count() == 0
