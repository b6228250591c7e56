"""One rank of the two-process gloo test of the load-balancing samplers.

Run as ``python _sampler_dist_worker.py RANK WORLD_SIZE PORT OUT_JSON``; it joins a gloo
process group on 127.0.0.1, builds the samplers with world_size and rank left to their
process-group defaults, and writes what this rank drew over two epochs to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from ortrain.utils.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

DATASET_SIZE = 1003  # odd, so two ranks need one padding sample
BATCH_SIZE = 8


def dataset_lengths() -> list[int]:
    rng = np.random.default_rng(1234)
    return (np.minimum(rng.lognormal(4.0, 1.0, DATASET_SIZE), 5000).astype(int) + 1).tolist()


def batch_fn(indices: list[int]) -> list[list[int]]:
    return [indices[i : i + BATCH_SIZE] for i in range(0, len(indices), BATCH_SIZE)]


def main() -> None:
    rank, world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        lengths = dataset_lengths()
        sampler = LoadBalancingDistributedSampler(lengths, lambda x: x)
        batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn)
        result: dict[str, object] = {"world_size": sampler.world_size, "rank": sampler.rank, "epochs": []}
        for epoch in range(2):
            batch_sampler.set_epoch(epoch)
            indices = list(sampler)
            batches = list(batch_sampler)
            # A collective per batch, as a training step has: unequal batch counts would hang here
            # (and fail on the 30 s timeout) instead of finishing.
            steps = 0
            for _ in batches:
                dist.barrier()
                steps += 1
            result["epochs"].append({"indices": indices, "batches": batches, "steps": steps})
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
