"""Benchmark the load-balancing samplers against torch.utils.data.DistributedSampler.

For a dataset of long-tailed sample lengths (1,000,000 by default) it measures, per world size:

* wall time to build a LoadBalancingDistributedSampler (this includes the one Python call of
  ``complexity_fn`` per sample), to iterate one epoch, and one epoch of the batch sampler;
* the simulated cost of an epoch: at every step each rank's cost is the summed complexity of
  its batch, the step costs what its slowest rank costs, and the epoch the sum over steps.
  The ratio ortrain / DistributedSampler is < 1 when load balancing saves time; "vs ideal"
  compares with a perfect split (total cost / world size).

Timings are medians over ``--repeats`` runs; costs are medians over ``--epochs`` epochs.

    python benchmarks/bench_sampler.py [--samples 1000000] [--batch-size 32] [--world-sizes 2 8 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from torch.utils.data import DistributedSampler

from ortrain.utils.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def long_tailed_lengths(n: int, seed: int) -> list[int]:
    # Log-normal token counts (median ~245, mean ~400, p99.9 ~5,600), clipped like a tokenizer's
    # max length: the shape of speech and text corpora that makes ranks straggle.
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.0, n), 1, 16384).astype(np.int64).tolist()


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def epoch_cost(lengths: np.ndarray, shards: np.ndarray, batch_size: int) -> float:
    """Sum over steps of the slowest rank's summed complexity; ``shards`` is (ranks, samples)."""
    costs = lengths[shards]
    pad = -costs.shape[1] % batch_size  # a last partial batch costs what its samples cost
    costs = np.pad(costs, ((0, 0), (0, pad)))
    per_step = costs.reshape(costs.shape[0], -1, batch_size).sum(axis=2)
    return float(per_step.max(axis=0).sum())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--repeats", type=int, default=5, help="runs per timing (median)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per cost (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dataset = long_tailed_lengths(args.samples, args.seed)
    lengths = np.asarray(dataset, dtype=np.float64)
    bs = args.batch_size

    def batch_fn(indices: list[int]) -> list[list[int]]:
        return [indices[i : i + bs] for i in range(0, len(indices), bs)]

    print(
        f"dataset: {args.samples:,} samples, lengths log-normal: median {np.median(lengths):.0f}, "
        f"mean {lengths.mean():.0f}, p99 {np.percentile(lengths, 99):.0f}, max {lengths.max():.0f}; "
        f"batch {bs} samples per rank; timings median of {args.repeats}, costs median of {args.epochs} epochs"
    )
    header = (
        f"{'ranks':>5} | {'build s':>7} | {'epoch s':>7} | {'batches s':>9} | {'torch epoch s':>13} | "
        f"{'ortrain cost':>12} | {'torch cost':>12} | {'ratio':>5} | "
        f"{'ortrain/ideal':>13} | {'torch/ideal':>11}"
    )
    print(header)
    print("-" * len(header))
    for ws in args.world_sizes:
        build = median_time(
            lambda ws=ws: LoadBalancingDistributedSampler(dataset, lambda x: x, world_size=ws, rank=0),
            args.repeats,
        )
        sampler = LoadBalancingDistributedSampler(dataset, lambda x: x, world_size=ws, rank=0)
        epochs = iter(range(1, 1_000_000))

        def one_epoch(sampler: LoadBalancingDistributedSampler = sampler, epochs=epochs) -> None:
            sampler.set_epoch(next(epochs))  # a fresh epoch, so the plan is computed, not cached
            for _ in sampler:
                pass

        iterate = median_time(one_epoch, args.repeats)
        batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn)

        def one_batch_epoch(batch_sampler=batch_sampler, epochs=epochs) -> None:
            batch_sampler.set_epoch(next(epochs))
            for _ in batch_sampler:
                pass

        batches = median_time(one_batch_epoch, args.repeats)
        torch_sampler = DistributedSampler(dataset, num_replicas=ws, rank=0, shuffle=True, seed=args.seed)

        def torch_epoch(torch_sampler=torch_sampler, epochs=epochs) -> None:
            torch_sampler.set_epoch(next(epochs))
            for _ in torch_sampler:
                pass

        torch_time = median_time(torch_epoch, args.repeats)

        ours, theirs = [], []
        for epoch in range(args.epochs):
            ours.append(epoch_cost(lengths, sampler.plan(epoch).T, bs))
            shards = []
            for r in range(ws):
                ts = DistributedSampler(dataset, num_replicas=ws, rank=r, shuffle=True, seed=args.seed)
                ts.set_epoch(epoch)
                shards.append(list(ts))
            theirs.append(epoch_cost(lengths, np.asarray(shards), bs))
        ours_cost, their_cost = statistics.median(ours), statistics.median(theirs)
        ideal = lengths.sum() / ws
        print(
            f"{ws:>5} | {build:>7.3f} | {iterate:>7.3f} | {batches:>9.3f} | {torch_time:>13.3f} | "
            f"{ours_cost:>12,.0f} | {their_cost:>12,.0f} | {ours_cost / their_cost:>5.3f} | "
            f"{ours_cost / ideal:>13.3f} | {their_cost / ideal:>11.3f}"
        )


if __name__ == "__main__":
    main()
