"""Group a load-balancing sampler's indices into batches, with the same number of batches on every rank."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ortrain.utils.data.load_balancing_sampler import LoadBalancingDistributedSampler

logger = logging.getLogger("ortrain.utils.data")

BatchFn = Callable[[list[int]], Sequence[Sequence[int]]]


class LoadBalancingDistributedBatchSampler:
    r"""Wrap a :class:`LoadBalancingDistributedSampler` to yield this rank's batches of sample indices.

    ``batch_fn(indices) -> list[list[int]]`` receives a rank's indices for the epoch, in step
    order, and groups them into batches (fixed size, or e.g. up to a token budget). Because
    position ``s`` holds samples of similar complexity on every rank, batch ``b`` of each rank
    covers similar samples when ``batch_fn`` groups by position.

    ``batch_fn`` can give ranks different numbers of batches, but every rank must run the same
    number of steps or the collective calls hang. Every rank therefore computes every rank's
    batches (from the sampler's plan, without communication) and evens the counts:

    * ``drop_last=False`` (default): ranks with fewer batches repeat their own batches from the
      start of the epoch until they have as many as the rank with the most;
    * ``drop_last=True``: every rank keeps only as many batches as the rank with the fewest.

    This costs one ``batch_fn`` call per rank per epoch on each process, done lazily the first
    time an epoch is iterated or its length asked for, and cached. The number of batches may
    change from epoch to epoch.

    Example::

        >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len)
        >>> batch_sampler = LoadBalancingDistributedBatchSampler(
        ...     sampler, batch_fn=lambda idx: [idx[i : i + 16] for i in range(0, len(idx), 16)])
        >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler)
        >>> for epoch in range(n_epochs):
        ...     batch_sampler.set_epoch(epoch)
        ...     train(loader)
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_fn: BatchFn, drop_last: bool = False):
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(
                f"sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}: the batch "
                "sampler needs every rank's plan to give all ranks the same number of batches"
            )
        if not callable(batch_fn):
            raise TypeError(f"batch_fn must be callable, got {type(batch_fn).__name__}")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = bool(drop_last)
        self.world_size = sampler.world_size
        self.rank = sampler.rank
        self._cache: tuple[tuple[Any, ...], list[list[int]]] | None = None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the wrapped sampler (the two share it)."""
        self.sampler.set_epoch(epoch)

    def batches_per_rank(self, epoch: int | None = None) -> list[list[list[int]]]:
        """Every rank's batches for ``epoch`` (default: the current one), before counts are evened."""
        plan = self.sampler.plan(epoch)
        return [self._call_batch_fn(rank, plan[:, rank].tolist()) for rank in range(self.world_size)]

    def __iter__(self) -> Iterator[list[int]]:
        # Copies: the cached batches serve every iteration of the epoch (and padding repeats the
        # same lists), so a caller that edits a batch in place must not change later ones.
        return (list(batch) for batch in self._batches())

    def __len__(self) -> int:
        return len(self._batches())

    def _batches(self) -> list[list[int]]:
        # Everything the batches depend on, as the sampler's plan reads its settings at each
        # iteration: until wave 44 a changed ``sampler.seed``, ``shuffle`` or ``random_level`` kept
        # the batches of the old plan, and ranks that had planned at different times overlapped.
        sampler = self.sampler
        settings = (sampler.seed, sampler.shuffle, sampler.random_level)
        key = (sampler.epoch, *settings, self.drop_last, self.batch_fn)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._even_batches(self.batches_per_rank(sampler.epoch)))
        return self._cache[1]

    def _even_batches(self, per_rank: list[list[list[int]]]) -> list[list[int]]:
        counts = [len(b) for b in per_rank]
        own = per_rank[self.rank]
        if self.drop_last:
            target = min(counts)
            if len(own) > target:
                logger.debug(
                    "rank %d drops %d of %d batches to match other ranks",
                    self.rank,
                    len(own) - target,
                    len(own),
                )
            return own[:target]
        target = max(counts)
        if not own:
            if target:
                raise ValueError(
                    f"batch_fn returned no batches for rank {self.rank} but {target} for another rank: "
                    "there is nothing to repeat to give all ranks the same number of batches"
                )
            return []
        if len(own) < target:
            logger.debug("rank %d repeats %d batches to match other ranks", self.rank, target - len(own))
        return [own[i % len(own)] for i in range(target)]

    def _call_batch_fn(self, rank: int, indices: list[int]) -> list[list[int]]:
        result = self.batch_fn(list(indices))
        where = f"batch_fn must return a list of lists of sample indices, but for rank {rank}"
        if not _is_index_container(result):
            raise TypeError(f"{where} it returned {type(result).__name__}")
        allowed = set(indices)
        batches: list[list[int]] = []
        for b, batch in enumerate(result):
            if not _is_index_container(batch):
                raise TypeError(f"{where} batch {b} is a {type(batch).__name__}, not a list of indices")
            if isinstance(batch, np.ndarray):
                if batch.ndim != 1 or batch.dtype.kind not in "iu":
                    raise TypeError(
                        f"{where} batch {b} is an array of shape {batch.shape} and dtype {batch.dtype}, "
                        "not a 1-D array of int indices"
                    )
                batch = batch.tolist()
            if len(batch) == 0:
                raise ValueError(f"{where} batch {b} is empty")
            # Checking the distinct element types and a set inclusion keeps this linear and fast
            # (it runs over the whole dataset every epoch); the loops only find what to report.
            if set(map(type, batch)) - {int}:
                for index in batch:
                    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
                        raise TypeError(
                            f"{where} batch {b} holds {index!r} ({type(index).__name__}), not an int index"
                        )
                batch = [int(i) for i in batch]
            if not allowed.issuperset(batch):
                stray = next(i for i in batch if i not in allowed)
                raise ValueError(
                    f"{where} batch {b} holds index {stray}, which is not one of the indices it was "
                    "given: batches must be drawn from the rank's own samples to keep shards disjoint"
                )
            batches.append(list(batch))
        return batches


def _is_index_container(value: object) -> bool:
    # Lists and tuples (any Sequence but text) and numpy arrays, e.g. from np.array_split.
    if isinstance(value, np.ndarray):
        return value.ndim >= 1
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)
