"""Freed memory reuse (``ORTMODULE_REUSE_FREED_MEMORY``): eager PyTorch and ortrain, each with
glibc malloc as it comes and with ortrain's thresholds, on the built-in models: step time, minor
page faults and system time per step, peak RSS. Each (model, variant, repeat) is one run of
:func:`ortrain.bench.run_competitor` in a fresh process (``python -m ortrain.bench --child``);
repeats are interleaved and the table reports medians.

    python benchmarks/bench_freed_memory.py [--models mlp,gpt] [--repeats 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from ortrain.bench import MODEL_LABELS, environment

# (label, ortrain.bench competitor, ORTMODULE_REUSE_FREED_MEMORY): eager gets the thresholds as
# the "eager-malloc" competitor, ortrain from its wrapper unless the variable is 0.
VARIANTS = (
    ("eager", "eager", False),
    ("eager", "eager-malloc", True),
    ("ortrain", "ortrain", False),
    ("ortrain", "ortrain", True),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    env = environment()
    print(f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}; medians of {args.repeats} runs")
    print(
        "| model | competitor | malloc | step ms | vs eager | page faults / step | system ms / step "
        "| peak RSS MiB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for model_name in args.models.split(","):
        runs: list[list[dict[str, float]]] = [[] for _ in VARIANTS]
        for _ in range(args.repeats):
            for variant, (_, competitor, reuse) in enumerate(VARIANTS):
                variables = dict(os.environ, ORTMODULE_REUSE_FREED_MEMORY="1" if reuse else "0")
                command = [sys.executable, "-m", "ortrain.bench", "--child", model_name, competitor]
                command += ["--steps", str(args.steps)]
                done = subprocess.run(command, capture_output=True, text=True, env=variables, check=True)
                runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
        keys = ("step_ms", "faults", "system_ms", "peak_mib")
        medians = [{k: statistics.median(r[k] for r in variant_runs) for k in keys} for variant_runs in runs]
        eager_ms = medians[0]["step_ms"]
        for (label, _, reuse), m in zip(VARIANTS, medians, strict=True):
            print(
                f"| {MODEL_LABELS.get(model_name, model_name)} | {label} "
                f"| {'reused' if reuse else 'as it comes'} | {m['step_ms']:.1f} "
                f"| {m['step_ms'] / eager_ms:.2f} "
                f"| {m['faults']:.0f} | {m['system_ms']:.1f} | {m['peak_mib']:.0f} |"
            )


if __name__ == "__main__":
    main()
