"""Collections during a compile skip older objects, and nothing stays frozen after it."""

from __future__ import annotations

import gc
import weakref

import torch

from ortrain import ORTModule
from ortrain.runtime.collector_pauses import older_objects_frozen


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_older_garbage_waits_for_the_compile_then_is_collected() -> None:
    assert gc.get_freeze_count() == 0
    old = _Cycle()
    old_ref = weakref.ref(old)
    del old  # garbage, reachable only from its own cycle
    with older_objects_frozen():
        assert gc.get_freeze_count() > 0
        young = _Cycle()
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None  # created during the compile: collected as usual
        assert old_ref() is not None  # frozen: skipped by the walk
        with older_objects_frozen():  # a nested compile does not unfreeze early
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None


def test_a_process_that_froze_objects_itself_is_left_alone() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # not unfrozen behind the user's back
    finally:
        gc.unfreeze()


def test_first_step_leaves_nothing_frozen() -> None:
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    model(torch.randn(2, 4)).sum().backward()
    assert gc.get_freeze_count() == 0
    assert all(p.grad is not None for p in model.parameters())


def _full_collections() -> int:
    return gc.get_stats()[-1]["collections"]


def test_a_full_collection_during_the_compile_is_followed_by_one_over_everything() -> None:
    before = _full_collections()
    with older_objects_frozen():
        pass  # graphs loaded from the cache: nothing collected, nothing added
    assert _full_collections() == before
    with older_objects_frozen():
        gc.collect()  # walks only the young objects: Python's long-lived count is now too small
    assert _full_collections() == before + 2  # one more after unfreezing resets it
