"""Freed memory reuse (``ORTMODULE_REUSE_FREED_MEMORY``): eager PyTorch and ortrain, each with
glibc malloc as it comes and with ortrain's thresholds, on the built-in models: step time, minor
page faults and system time per step, peak RSS. Each (model, variant, repeat) runs in a fresh
process; repeats are interleaved and the table reports medians.

    python benchmarks/bench_freed_memory.py [--models mlp,gpt] [--repeats 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# (competitor, ortrain's malloc thresholds)
VARIANTS = (("eager", False), ("eager", True), ("ortrain", False), ("ortrain", True))


def child(model_name: str, competitor: str, reuse: bool, steps: int) -> dict[str, float]:
    import torch

    from ortrain.bench import _train_step, build_model, train_while_tuning
    from ortrain.inspector.memory_stats import process_memory_mib

    if competitor == "eager" and reuse:
        from ortrain.runtime.freed_memory_reuse import reuse_freed_memory

        reuse_freed_memory(True, users_setting=None)
    model, batch = build_model(model_name)
    if competitor == "ortrain":
        from ortrain import ORTModule

        model = ORTModule(model)  # applies the thresholds unless ORTMODULE_REUSE_FREED_MEMORY=0
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    _train_step(model, optimizer, batch)
    if competitor == "ortrain":
        train_while_tuning(model, lambda: _train_step(model, optimizer, batch))
    for _ in range(3):
        _train_step(model, optimizer, batch)
    before = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _train_step(model, optimizer, batch)
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "step_ms": statistics.median(times) * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / steps,
        "system_ms": (after.ru_stime - before.ru_stime) * 1e3 / steps,
        "peak_mib": process_memory_mib()[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "COMPETITOR", "REUSE"))
    args = parser.parse_args()
    if args.child:
        model_name, competitor, reuse = args.child
        print(json.dumps(child(model_name, competitor, reuse == "1", args.steps)))
        return

    from ortrain.bench import MODEL_LABELS, environment

    env = environment()
    print(f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}; medians of {args.repeats} runs")
    print(
        "| model | competitor | malloc | step ms | vs eager | page faults / step | system ms / step "
        "| peak RSS MiB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for model_name in args.models.split(","):
        runs: dict[tuple[str, bool], list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for competitor, reuse in VARIANTS:
                switch = "1" if reuse else "0"
                variables = dict(os.environ, ORTMODULE_REUSE_FREED_MEMORY=switch)
                command = [sys.executable, __file__, "--steps", str(args.steps)]
                command += ["--child", model_name, competitor, switch]
                done = subprocess.run(command, capture_output=True, text=True, env=variables, check=True)
                runs[(competitor, reuse)].append(json.loads(done.stdout.strip().splitlines()[-1]))
        medians = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
        eager_ms = medians[("eager", False)]["step_ms"]
        for (competitor, reuse), m in medians.items():
            print(
                f"| {MODEL_LABELS.get(model_name, model_name)} | {competitor} "
                f"| {'reused' if reuse else 'as it comes'} | {m['step_ms']:.1f} "
                f"| {m['step_ms'] / eager_ms:.2f} "
                f"| {m['faults']:.0f} | {m['system_ms']:.1f} | {m['peak_mib']:.0f} |"
            )


if __name__ == "__main__":
    main()
