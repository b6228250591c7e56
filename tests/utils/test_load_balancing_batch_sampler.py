"""LoadBalancingDistributedBatchSampler: equal batch counts, balance, epochs and batch_fn errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ortrain.utils.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def long_tailed_lengths(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return (np.minimum(rng.lognormal(4.0, 1.0, n), 5000).astype(int) + 1).tolist()


def identity(x):
    return x


def fixed_size(size: int):
    def batch_fn(indices: list[int]) -> list[list[int]]:
        return [indices[i : i + size] for i in range(0, len(indices), size)]

    return batch_fn


def token_budget(dataset: list[int], budget: int):
    """Close a batch once its summed length reaches the budget: counts differ between ranks."""

    def batch_fn(indices: list[int]) -> list[list[int]]:
        batches, current, total = [], [], 0
        for i in indices:
            current.append(i)
            total += dataset[i]
            if total >= budget:
                batches.append(current)
                current, total = [], 0
        if current:
            batches.append(current)
        return batches

    return batch_fn


def batch_samplers(dataset, world_size, batch_fn, drop_last=False, **kwargs):
    return [
        LoadBalancingDistributedBatchSampler(
            LoadBalancingDistributedSampler(dataset, identity, world_size=world_size, rank=r, **kwargs),
            batch_fn,
            drop_last=drop_last,
        )
        for r in range(world_size)
    ]


def test_fixed_size_batches_cover_the_rank_in_order():
    dataset = long_tailed_lengths(103)
    for bs in batch_samplers(dataset, 2, fixed_size(8)):
        batches = list(bs)
        assert len(bs) == len(batches) == 7  # 52 samples per rank
        assert [i for b in batches for i in b] == list(bs.sampler)
        assert all(type(i) is int for b in batches for i in b)


@pytest.mark.parametrize("drop_last", [False, True])
def test_all_ranks_get_the_same_number_of_batches(drop_last):
    dataset = long_tailed_lengths(2000, seed=1)
    world_size = 4
    # random_level=1 unbalances the ranks enough for a token budget to give them different counts.
    samplers = batch_samplers(
        dataset, world_size, token_budget(dataset, 1500), drop_last=drop_last, random_level=1.0
    )
    raw_counts = [len(b) for b in samplers[0].batches_per_rank()]
    assert len(set(raw_counts)) > 1, "the test needs a batch_fn that gives ranks different counts"
    expected = min(raw_counts) if drop_last else max(raw_counts)
    per_rank = [list(bs) for bs in samplers]
    assert [len(b) for b in per_rank] == [expected] * world_size
    assert [len(bs) for bs in samplers] == [expected] * world_size
    for rank, batches in enumerate(per_rank):
        own = samplers[rank].batches_per_rank()[rank]
        if drop_last:
            assert batches == own[:expected]
        else:
            # Padding repeats the rank's own batches from the start of the epoch.
            assert batches == [own[i % len(own)] for i in range(expected)]


def test_batches_are_balanced_across_ranks_at_each_step():
    dataset = long_tailed_lengths(4096, seed=2)
    c = np.asarray(dataset, dtype=float)
    per_rank = [list(bs) for bs in batch_samplers(dataset, 8, fixed_size(16))]
    step_costs = np.array([[c[b].sum() for b in batches] for batches in per_rank])  # (ranks, steps)
    slowest = step_costs.max(axis=0).sum()
    ideal = c.sum() / 8
    assert slowest < 1.05 * ideal
    random_plan = np.random.default_rng(0).permutation(len(c)).reshape(8, -1, 16)
    assert c[random_plan].sum(axis=2).max(axis=0).sum() > 1.3 * ideal


def test_set_epoch_on_batch_sampler_reshuffles_and_reiteration_repeats():
    dataset = long_tailed_lengths(400, seed=3)
    bs = batch_samplers(dataset, 2, token_budget(dataset, 600))[1]
    first = list(bs)
    assert list(bs) == first
    bs.set_epoch(1)
    assert bs.epoch == bs.sampler.epoch == 1
    second = list(bs)
    assert second != first
    # The sampler and the batch sampler share the epoch: setting it on the sampler works too.
    bs.sampler.set_epoch(0)
    assert list(bs) == first


@pytest.mark.parametrize(("setting", "value"), [("seed", 123), ("shuffle", False), ("random_level", 0.5)])
def test_a_changed_sampler_setting_gives_the_batches_of_the_new_plan(setting, value):
    """The batches were cached by epoch alone until wave 44: after ``sampler.seed = 123`` the
    sampler planned anew and the batch sampler kept yielding the old plan's batches."""
    dataset = long_tailed_lengths(200, seed=4)
    stale = batch_samplers(dataset, 2, fixed_size(8), shuffle=True)[0]
    len(stale)  # plans the epoch with the old settings
    setattr(stale.sampler, setting, value)
    fresh = batch_samplers(dataset, 2, fixed_size(8), **{"shuffle": True, setting: value})[0]
    assert list(stale) == list(fresh)


def test_dataloader_with_batch_sampler_over_two_epochs():
    lengths = long_tailed_lengths(90, seed=4)
    dataset = [torch.full((1,), float(i)) for i in range(len(lengths))]
    samplers = [
        LoadBalancingDistributedBatchSampler(
            LoadBalancingDistributedSampler(lengths, identity, world_size=3, rank=r), fixed_size(5)
        )
        for r in range(3)
    ]
    epochs = []
    for epoch in range(2):
        seen = []
        for bs in samplers:
            bs.set_epoch(epoch)
            loader = DataLoader(dataset, batch_sampler=bs)
            seen.append([t.view(-1).long().tolist() for t in loader])
        assert [len(s) for s in seen] == [6, 6, 6]
        flat = [i for s in seen for b in s for i in b]
        assert sorted(flat) == list(range(90))
        epochs.append(seen)
    assert epochs[0] != epochs[1]


def test_batch_fn_called_per_rank_once_per_epoch():
    calls = []

    def batch_fn(indices):
        calls.append(len(indices))
        return fixed_size(4)(indices)

    bs = batch_samplers(list(range(40)), 2, batch_fn)[0]
    list(bs)
    list(bs)
    len(bs)
    assert calls == [20, 20]
    bs.set_epoch(1)
    list(bs)
    assert calls == [20, 20, 20, 20]


@pytest.mark.parametrize(
    ("batch_fn", "error", "message"),
    [
        (
            lambda idx: 3,
            TypeError,
            r"must return a list of lists of sample indices, but for rank 0 it returned int",
        ),
        (lambda idx: "0 1", TypeError, r"for rank 0 it returned str"),
        (lambda idx: idx, TypeError, r"for rank 0 batch 0 is a int, not a list of indices"),
        (lambda idx: [[str(i) for i in idx]], TypeError, r"batch 0 holds '\d+' \(str\), not an int index"),
        (lambda idx: [[float(i) for i in idx]], TypeError, r"batch 0 holds \d+\.0 \(float\)"),
        (lambda idx: [[True]], TypeError, r"batch 0 holds True \(bool\)"),
        (lambda idx: [idx, []], ValueError, r"for rank 0 batch 1 is empty"),
        (lambda idx: [[1000]], ValueError, r"batch 0 holds index 1000, which is not one of the indices"),
    ],
)
def test_batch_fn_returning_something_other_than_lists_of_indices_is_refused(batch_fn, error, message):
    bs = batch_samplers(list(range(10)), 2, batch_fn)[0]
    with pytest.raises(error, match=message):
        list(bs)


def test_array_split_batches_are_accepted():
    bs = batch_samplers(list(range(10)), 1, lambda idx: np.array_split(np.asarray(idx), 3))[0]
    batches = list(bs)
    assert [len(b) for b in batches] == [4, 3, 3]
    assert all(type(i) is int for b in batches for i in b)
    bad = batch_samplers(list(range(10)), 1, lambda idx: [np.asarray(idx, dtype=float)])[0]
    with pytest.raises(TypeError, match=r"batch 0 is an array of shape \(10,\) and dtype float64"):
        list(bad)


def test_numpy_and_tuple_batches_are_accepted():
    bs = batch_samplers(list(range(8)), 1, lambda idx: [tuple(np.asarray(idx[:4])), idx[4:]])[0]
    batches = list(bs)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(type(i) is int for b in batches for i in b)


def test_rank_without_batches_cannot_be_padded():
    # Rank 1 gets no batches while rank 0 does: repeating "nothing" cannot even the counts.
    def batch_fn(idx):
        return [idx] if 0 in idx else []

    bs = batch_samplers(list(range(4)), 2, batch_fn, shuffle=False)
    rank_without = next(b for b in bs if 0 not in list(b.sampler))
    with pytest.raises(ValueError, match="returned no batches for rank"):
        list(rank_without)
    rank_without.drop_last = True
    assert list(rank_without) == []


def test_bad_sampler_or_batch_fn_type():
    with pytest.raises(TypeError, match="sampler must be a LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(range(4), fixed_size(2))
    sampler = LoadBalancingDistributedSampler([1, 2], identity, world_size=1, rank=0)
    with pytest.raises(TypeError, match="batch_fn must be callable"):
        LoadBalancingDistributedBatchSampler(sampler, 4)
