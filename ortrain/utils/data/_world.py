"""Resolve the data-parallel world (number of ranks and this process's rank) for a sampler."""

from __future__ import annotations

import logging
import numbers

import torch.distributed as dist

logger = logging.getLogger("ortrain.utils.data")


def _as_int(name: str, value: object) -> int:
    # bool is an Integral subclass; accepting True as "1 rank" would hide a swapped argument.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    return int(value)


def resolve_world(world_size: int | None, rank: int | None) -> tuple[int, int]:
    """Return ``(world_size, rank)``, filling ``None`` from the default ``torch.distributed`` group.

    Without an initialised process group, leaving both unset means a single process
    (world of 1, rank 0), so the samplers also work in plain single-process training.
    Leaving only one unset is refused: a world size without a rank (or the reverse) is
    almost always a launch mistake, and guessing would silently give every process the
    same shard.
    """
    group_ready = dist.is_available() and dist.is_initialized()
    if group_ready:
        if world_size is None:
            world_size = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
    elif world_size is None and rank is None:
        logger.debug("no torch.distributed process group initialised: using world_size=1, rank=0")
        world_size, rank = 1, 0
    elif rank is None:
        raise ValueError(
            f"world_size={world_size} was given but rank was not, and no torch.distributed process "
            "group is initialised to take it from: pass rank explicitly"
        )
    elif world_size is None:
        raise ValueError(
            f"rank={rank} was given but world_size was not, and no torch.distributed process "
            "group is initialised to take it from: pass world_size explicitly"
        )

    world_size = _as_int("world_size", world_size)
    rank = _as_int("rank", rank)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world: it must be in [0, {world_size - 1}]")
    return world_size, rank
