"""LoadBalancingDistributedSampler: sharding, balance, randomness, epochs and argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ortrain.utils.data import LoadBalancingDistributedSampler


def long_tailed_lengths(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return (np.minimum(rng.lognormal(4.0, 1.0, n), 5000).astype(int) + 1).tolist()


def identity(x):
    return x


def all_ranks(dataset, world_size: int, **kwargs) -> list[list[int]]:
    """Each rank's indices, from one sampler per rank as separate processes would build them."""
    return [
        list(LoadBalancingDistributedSampler(dataset, identity, world_size=world_size, rank=r, **kwargs))
        for r in range(world_size)
    ]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(float)
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable").astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def test_importable_from_package():
    import ortrain.utils.data as data

    assert data.LoadBalancingDistributedSampler is LoadBalancingDistributedSampler
    assert "LoadBalancingDistributedBatchSampler" in data.__all__


@pytest.mark.parametrize("n", [1, 5, 64, 1001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"shuffle": False},
        {"group_size": 16},
        {"group_size": 10, "shuffle": False},
        {"random_level": 0.5},
    ],
)
def test_shards_disjoint_cover_and_equal_with_padding(n, world_size, options):
    dataset = long_tailed_lengths(n)
    shards = all_ranks(dataset, world_size, **options)
    expected = math.ceil(n / world_size)
    assert [len(s) for s in shards] == [expected] * world_size
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n))  # every sample is seen
    # Only the padding repeats samples: exactly total - n extra entries.
    assert len(flat) - n == expected * world_size - n
    assert all(isinstance(i, int) for i in flat)


@pytest.mark.parametrize("n", [1, 5, 64, 1001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("options", [{}, {"shuffle": False}, {"group_size": 16}, {"group_size": 7}])
def test_drop_last_gives_disjoint_equal_shards_without_repeats(n, world_size, options):
    shards = all_ranks(long_tailed_lengths(n), world_size, drop_last=True, **options)
    assert [len(s) for s in shards] == [n // world_size] * world_size
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == (n // world_size) * world_size
    assert set(flat) <= set(range(n))


def test_drop_last_without_shuffle_drops_the_last_indices():
    shards = all_ranks(long_tailed_lengths(10), 4, drop_last=True, shuffle=False)
    assert sorted(i for s in shards for i in s) == list(range(8))


def test_every_rank_computes_the_same_plan_and_iterates_its_column():
    dataset = long_tailed_lengths(500)
    samplers = [LoadBalancingDistributedSampler(dataset, identity, world_size=4, rank=r) for r in range(4)]
    for epoch in (0, 3):
        for s in samplers:
            s.set_epoch(epoch)
        plans = [s.plan() for s in samplers]
        for r, s in enumerate(samplers):
            np.testing.assert_array_equal(plans[r], plans[0])
            assert list(s) == plans[0][:, r].tolist()
    assert plans[0].shape == (125, 4)
    assert not plans[0].flags.writeable


def test_random_level_zero_deals_perfectly_sorted_chunks():
    dataset = long_tailed_lengths(1000)
    c = np.asarray(dataset, dtype=float)
    for shuffle in (False, True):
        plan = LoadBalancingDistributedSampler(
            dataset, identity, world_size=4, rank=0, shuffle=shuffle, random_level=0.0
        ).plan()
        step_costs = c[plan]
        # Each step holds a window of the sorted complexities: ordering the (sorted) steps
        # lexicographically and concatenating them reproduces the fully sorted dataset.
        rows = np.sort(step_costs, axis=1)
        rows = rows[np.lexsort(rows.T[::-1])]
        np.testing.assert_array_equal(rows.ravel(), np.sort(c))
        if not shuffle:
            # Without shuffling, steps run from cheapest to most expensive.
            assert np.all(np.diff(step_costs.min(axis=1)) >= 0)


def test_random_level_blends_from_sorted_to_uncorrelated():
    dataset = long_tailed_lengths(20000, seed=1)
    c = np.asarray(dataset, dtype=float)

    def correlation(level: float) -> float:
        plan = LoadBalancingDistributedSampler(
            dataset, identity, world_size=1, rank=0, shuffle=False, random_level=level, seed=7
        ).plan()
        order = plan.ravel()
        return spearman(np.arange(len(order)), c[order])

    rho = {level: correlation(level) for level in (0.0, 0.25, 0.5, 1.0)}
    assert rho[0.0] > 0.999
    assert rho[0.0] > rho[0.25] > rho[0.5] > rho[1.0]
    # 20000 samples: the standard error of Spearman's rho under independence is ~0.007.
    assert abs(rho[1.0]) < 0.03


def test_random_level_one_makes_steps_as_unbalanced_as_random_sharding():
    dataset = long_tailed_lengths(8000, seed=2)
    c = np.asarray(dataset, dtype=float)

    def mean_step_spread(level: float) -> float:
        plan = LoadBalancingDistributedSampler(
            dataset, identity, world_size=8, rank=0, random_level=level
        ).plan()
        costs = c[plan]
        return float((costs.max(axis=1) - costs.min(axis=1)).mean())

    random_plan = np.random.default_rng(3).permutation(len(c)).reshape(-1, 8)
    random_spread = float((c[random_plan].max(axis=1) - c[random_plan].min(axis=1)).mean())
    assert mean_step_spread(0.0) < 0.05 * random_spread
    assert 0.8 * random_spread < mean_step_spread(1.0) < 1.2 * random_spread


def test_steps_are_balanced_compared_with_distributed_sampler():
    dataset = long_tailed_lengths(4096, seed=4)
    c = np.asarray(dataset, dtype=float)
    world_size, batch = 8, 16

    def slowest_rank_total(shards: list[list[int]]) -> float:
        costs = c[np.asarray(shards)]  # (ranks, samples)
        steps = costs.reshape(world_size, -1, batch).sum(axis=2)  # (ranks, steps)
        return float(steps.max(axis=0).sum())

    ours = slowest_rank_total(all_ranks(dataset, world_size))
    torch_shards = [
        list(DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True))
        for r in range(world_size)
    ]
    theirs = slowest_rank_total(torch_shards)
    ideal = c.sum() / world_size
    assert ours < theirs
    assert ours < 1.02 * ideal


def test_snake_dealing_spreads_the_largest_sample_of_each_step():
    plan = LoadBalancingDistributedSampler(
        list(range(400)), identity, world_size=4, rank=0, shuffle=False
    ).plan()
    costs = plan.astype(float)  # complexity == index here
    holder_of_max = costs.argmax(axis=1)
    counts = np.bincount(holder_of_max, minlength=4)
    assert counts[0] == counts[3] == 50
    totals = costs.sum(axis=0)
    assert totals.max() - totals.min() <= 4 * 3


def test_group_size_without_shuffle_sorts_inside_dataset_groups():
    dataset = long_tailed_lengths(96, seed=5)
    c = np.asarray(dataset, dtype=float)
    plan = LoadBalancingDistributedSampler(
        dataset, identity, world_size=4, rank=0, shuffle=False, group_size=32
    ).plan()
    for g in range(3):
        rows = plan[g * 8 : (g + 1) * 8]
        assert sorted(rows.ravel().tolist()) == list(range(g * 32, (g + 1) * 32))
        row_costs = np.sort(c[rows], axis=1)
        np.testing.assert_array_equal(row_costs.ravel(), np.sort(c[g * 32 : (g + 1) * 32]))


def test_group_size_with_shuffle_buckets_and_changes_groups_between_epochs():
    dataset = long_tailed_lengths(960, seed=6)
    c = np.asarray(dataset, dtype=float)
    sampler = LoadBalancingDistributedSampler(dataset, identity, world_size=4, rank=0, group_size=64)
    rows_per_group = 64 // 4
    groups_by_epoch = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        plan = sampler.plan()
        mins = c[plan].min(axis=1).reshape(-1, rows_per_group)
        # Inside a group, steps go from cheap to expensive: batches of similar length.
        assert np.all(np.diff(mins, axis=1) >= 0)
        groups_by_epoch.append({frozenset(plan[g * 16 : (g + 1) * 16].ravel().tolist()) for g in range(15)})
        # Groups are random subsets of the dataset, not runs of consecutive indices.
        assert frozenset(range(64)) not in groups_by_epoch[-1]
    assert groups_by_epoch[0] != groups_by_epoch[1]


def test_group_size_not_multiple_of_world_size_keeps_chunks_inside_groups():
    # Complexity == index and no shuffle: a chunk straddling groups would pair index ~59 with ~60.
    plan = LoadBalancingDistributedSampler(
        list(range(120)), identity, world_size=4, rank=0, shuffle=False, group_size=30
    ).plan()
    for row in plan[:-2]:
        assert len({i // 30 for i in row.tolist()}) == 1
    # The 2 leftovers of each of the 4 groups are pooled into the final two steps.
    assert sorted(plan[-2:].ravel().tolist()) == [28, 29, 58, 59, 88, 89, 118, 119]


def test_group_leftovers_are_shuffled_among_the_groups_chunks():
    """The samples left over in each group are its largest: until wave 41 their chunks came last,
    in ascending order, the same every epoch (with group_size under world_size every sample was a
    leftover, and shuffling did nothing)."""
    lengths = long_tailed_lengths(4096)
    for group_size, world_size in ((100, 64), (32, 64)):
        sampler = LoadBalancingDistributedSampler(
            lengths, identity, world_size=world_size, rank=0, group_size=group_size
        )
        plans = [sampler.plan(epoch) for epoch in (0, 1)]
        assert not np.array_equal(plans[0], plans[1])
        for plan in plans:
            step_max = [max(lengths[i] for i in row.tolist()) for row in plan]
            assert step_max != sorted(step_max)  # not a run sorted by length
            third = len(step_max) // 3
            assert np.mean(step_max[-third:]) < 1.5 * np.mean(step_max[:third])  # no heavy tail
            assert sorted(plan.ravel().tolist()) == sorted(range(len(lengths)))  # each sample once


def test_settings_changed_after_an_epoch_are_read():
    """``sampler.seed = 1`` after an iteration: the next plan is seed 1's, as torch's sampler."""
    sampler = LoadBalancingDistributedSampler(list(range(40)), identity, world_size=2, rank=0, seed=0)
    list(sampler)
    sampler.seed = 123
    fresh = LoadBalancingDistributedSampler(list(range(40)), identity, world_size=2, rank=0, seed=123)
    assert list(sampler) == list(fresh)


def test_same_epoch_same_order_new_epoch_new_order_and_reiteration_works():
    sampler = LoadBalancingDistributedSampler(long_tailed_lengths(300), identity, world_size=2, rank=1)
    first = list(sampler)
    assert list(sampler) == first  # second iteration without set_epoch: same order, no failure
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    assert sorted(second) != second
    sampler.set_epoch(0)
    assert list(sampler) == first
    assert list(sampler) == first


def test_seed_changes_the_order_and_negative_seeds_work():
    dataset = long_tailed_lengths(300)
    a = list(LoadBalancingDistributedSampler(dataset, identity, world_size=2, rank=0, seed=0))
    b = list(LoadBalancingDistributedSampler(dataset, identity, world_size=2, rank=0, seed=1))
    c = list(LoadBalancingDistributedSampler(dataset, identity, world_size=2, rank=0, seed=-5))
    assert a != b and a != c


def test_complexities_are_computed_once_per_sampler():
    calls = []

    def counting(x):
        calls.append(x)
        return x

    dataset = long_tailed_lengths(200)
    sampler = LoadBalancingDistributedSampler(dataset, counting, world_size=2, rank=0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        list(sampler)
        list(sampler)
    assert len(calls) == len(dataset)
    np.testing.assert_array_equal(sampler.complexities, np.asarray(dataset, dtype=float))


def test_dataloader_over_two_epochs():
    dataset = [torch.full((n,), float(i)) for i, n in enumerate(long_tailed_lengths(64, seed=8))]
    samplers = [LoadBalancingDistributedSampler(dataset, len, world_size=2, rank=r) for r in range(2)]
    seen_by_epoch = []
    for epoch in range(2):
        seen = []
        for s in samplers:
            s.set_epoch(epoch)
            loader = DataLoader(dataset, sampler=s, batch_size=None)
            seen.append([int(t[0]) for t in loader])
        assert len(seen[0]) == len(seen[1]) == 32
        assert set(seen[0]).isdisjoint(seen[1])
        assert set(seen[0]) | set(seen[1]) == set(range(64))
        seen_by_epoch.append(seen)
    assert seen_by_epoch[0] != seen_by_epoch[1]


def test_defaults_to_a_single_process_without_process_group():
    sampler = LoadBalancingDistributedSampler(list(range(10)), identity)
    assert (sampler.world_size, sampler.rank) == (1, 0)
    assert sorted(sampler) == list(range(10))


def test_empty_dataset_and_dataset_smaller_than_world():
    assert list(LoadBalancingDistributedSampler([], identity, world_size=2, rank=0)) == []
    shards = all_ranks([3, 1], 4)
    assert all(len(s) == 1 for s in shards)
    assert {i for s in shards for i in s} == {0, 1}
    assert all_ranks([3, 1], 4, drop_last=True) == [[], [], [], []]


def test_accepts_numpy_and_tensor_complexities():
    data = [np.int32(3), np.float64(2.5), torch.tensor(7), torch.tensor([1.5]), 10**30]
    sampler = LoadBalancingDistributedSampler(data, identity, world_size=1, rank=0, shuffle=False)
    np.testing.assert_array_equal(sampler.complexities, [3, 2.5, 7, 1.5, 1e30])
    assert list(sampler) == [3, 1, 0, 2, 4]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world_size": 2, "rank": 2}, ValueError, r"rank 2 is outside the world: it must be in \[0, 1\]"),
        ({"world_size": 2, "rank": -1}, ValueError, r"rank -1 is outside the world"),
        ({"world_size": 0, "rank": 0}, ValueError, r"world_size must be at least 1"),
        ({"world_size": 2}, ValueError, r"world_size=2 was given but rank was not"),
        ({"rank": 1}, ValueError, r"rank=1 was given but world_size was not"),
        ({"world_size": 2.0, "rank": 0}, TypeError, r"world_size must be an int"),
        ({"random_level": -0.1}, ValueError, r"random_level must be in \[0, 1\], got -0.1"),
        ({"random_level": 1.5}, ValueError, r"random_level must be in \[0, 1\], got 1.5"),
        ({"random_level": float("nan")}, ValueError, r"random_level must be in \[0, 1\]"),
        ({"random_level": "high"}, TypeError, r"random_level must be a number"),
        ({"group_size": 0}, ValueError, r"group_size must be at least 1"),
        ({"seed": 1.5}, TypeError, r"seed must be an int"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs, error, message):
    with pytest.raises(error, match=message):
        LoadBalancingDistributedSampler(list(range(4)), identity, **kwargs)


@pytest.mark.parametrize(
    ("returned", "error", "message"),
    [
        ("3", TypeError, r"must return a real number .* sample 2 it returned str '3'"),
        (None, TypeError, r"sample 2 it returned NoneType None"),
        (True, TypeError, r"sample 2 it returned bool True"),
        ([1, 2], TypeError, r"sample 2 it returned list \[1, 2\]"),
        (1 + 2j, TypeError, r"sample 2 it returned complex"),
        (float("nan"), ValueError, r"must return finite numbers, but for sample 2 it returned float nan"),
        (float("inf"), ValueError, r"finite numbers, but for sample 2"),
        (torch.tensor([1, 2]), TypeError, r"sample 2 it returned a tensor of shape \(2,\)"),
        (torch.tensor(True), TypeError, r"sample 2 it returned a tensor of shape \(\) and dtype torch.bool"),
    ],
)
def test_complexity_fn_returning_non_numbers_is_refused(returned, error, message):
    def complexity_fn(x):
        return returned if x == 2 else x

    with pytest.raises(error, match=message):
        LoadBalancingDistributedSampler(list(range(4)), complexity_fn, world_size=1, rank=0)


def test_other_bad_inputs():
    with pytest.raises(TypeError, match="dataset must be map-style"):
        LoadBalancingDistributedSampler(iter(range(3)), identity, world_size=1, rank=0)

    class SizedStream(torch.utils.data.IterableDataset):  # has __len__; its __getitem__ raises
        def __iter__(self):
            return iter(range(3))

        def __len__(self) -> int:
            return 3

    with pytest.raises(TypeError, match=r"dataset must be map-style.*SizedStream"):
        LoadBalancingDistributedSampler(SizedStream(), identity, world_size=1, rank=0)
    with pytest.raises(TypeError, match="complexity_fn must be callable"):
        LoadBalancingDistributedSampler([1, 2], 3, world_size=1, rank=0)
    sampler = LoadBalancingDistributedSampler([1, 2], identity, world_size=1, rank=0)
    with pytest.raises(TypeError, match="epoch must be an int"):
        sampler.set_epoch(1.0)
