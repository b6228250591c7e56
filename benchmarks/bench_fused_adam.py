"""One optimizer step over 200 tensors / 50M parameters: FusedAdam against torch.optim.AdamW.

Competitors run side by side in one process, interleaved in rotating order, each on its own copy of the
parameters with the same gradients; the table shows the median step time and its ratio to the fastest
torch.optim.AdamW (foreach=True / fused=True).

    python benchmarks/bench_fused_adam.py [--device cuda] [--repeats 15] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ortrain.optim import AdamWMode, FusedAdam


def make_competitors(
    params_by_name: dict[str, list[torch.Tensor]], lr: float, wd: float
) -> dict[str, torch.optim.Optimizer]:
    return {
        "torch AdamW foreach": torch.optim.AdamW(
            params_by_name["torch AdamW foreach"], lr, weight_decay=wd, foreach=True
        ),
        "torch AdamW fused": torch.optim.AdamW(
            params_by_name["torch AdamW fused"], lr, weight_decay=wd, fused=True
        ),
        "FusedAdam ADAMW_TORCH": FusedAdam(
            params_by_name["FusedAdam ADAMW_TORCH"], lr, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=wd
        ),
        "FusedAdam ADAMW_TRANSFORMERS": FusedAdam(
            params_by_name["FusedAdam ADAMW_TRANSFORMERS"],
            lr,
            adam_w_mode=AdamWMode.ADAMW_TRANSFORMERS,
            weight_decay=wd,
        ),
    }


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--params", type=int, default=50_000_000, help="total number of parameters")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    # Mixed sizes like a real model (large matrices, small biases/norms), summing to --params.
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(args.tensors, generator=gen) ** 3 + 1e-3
    sizes = (weights / weights.sum() * args.params).long().clamp_min(1)
    sizes[0] += args.params - int(sizes.sum())
    grads = [torch.randn(int(n), generator=gen).to(device=device, dtype=dtype) for n in sizes]
    base = [torch.randn(int(n), generator=gen).to(device=device, dtype=dtype) for n in sizes]

    names = [
        "torch AdamW foreach",
        "torch AdamW fused",
        "FusedAdam ADAMW_TORCH",
        "FusedAdam ADAMW_TRANSFORMERS",
    ]
    params_by_name = {}
    for name in names:
        ps = [b.clone().requires_grad_() for b in base]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g
        params_by_name[name] = ps
    del base
    optimizers = make_competitors(params_by_name, lr=1e-3, wd=0.01)

    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.warmup + args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            elapsed = timed(optimizers[name].step, device)
            if rep >= args.warmup:
                times[name].append(elapsed)

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    fastest_torch = min(medians["torch AdamW foreach"], medians["torch AdamW fused"])
    print(
        f"device={device} dtype={args.dtype} tensors={args.tensors} params={int(sizes.sum()):,} "
        f"threads={torch.get_num_threads()} repeats={args.repeats} torch={torch.__version__}"
    )
    print(f"{'optimizer':<30} {'median ms':>10} {'min ms':>9} {'/ fastest torch':>16}")
    for name in names:
        print(
            f"{name:<30} {medians[name] * 1e3:>10.1f} {min(times[name]) * 1e3:>9.1f} "
            f"{medians[name] / fastest_torch:>16.3f}"
        )


if __name__ == "__main__":
    main()
