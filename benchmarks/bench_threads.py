"""Threads: eager against ortrain under each OpenMP wait policy, with the machine quiet and with a
busy process pinned to one core (contention), so a reader can see whether ortrain degrades more
than eager when it does not have the machine to itself.

ONNX Runtime's sessions take ``torch.get_num_threads()`` intra-op threads and never spin; PyTorch's
OpenMP threads spin after each op unless ``OMP_WAIT_POLICY=PASSIVE`` (read when the process starts,
so each configuration runs in its own process). Repeats are interleaved; medians.

    python benchmarks/bench_threads.py [--model mlp] [--repeats 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from ortrain import bench

POLICIES = ("", "PASSIVE")


def _busy_process() -> subprocess.Popen[bytes]:
    """A process spinning on core 0, as another job sharing the machine would."""
    code = "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def _run(model: str, competitor: str, policy: str, busy: bool, steps: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    command = [sys.executable, "-m", "ortrain.bench", "--child", model, competitor, "--steps", str(steps)]
    spinner = _busy_process() if busy else None
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if done.returncode != 0:
        raise RuntimeError(f"{model}/{competitor} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    env = bench.environment()
    print(
        f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}, onnxruntime {env['onnxruntime']}; "
        f"{bench.MODEL_LABELS.get(args.model, args.model)}, medians of {args.repeats} interleaved runs"
    )
    configs = [(p, busy) for busy in (False, True) for p in POLICIES]
    runs: dict[tuple[str, bool, str], list[float]] = {}
    for _ in range(args.repeats):
        for policy, busy in configs:
            for competitor in ("eager", "ortrain"):
                result = _run(args.model, competitor, policy, busy, args.steps)
                runs.setdefault((policy, busy, competitor), []).append(result["step_ms"])
    print("| OMP_WAIT_POLICY | machine | eager ms | ortrain ms | ortrain / eager |")
    print("|---|---|---:|---:|---:|")
    for policy, busy in configs:
        eager = statistics.median(runs[(policy, busy, "eager")])
        ortrain = statistics.median(runs[(policy, busy, "ortrain")])
        machine = "one core busy" if busy else "quiet"
        print(f"| {policy or 'unset'} | {machine} | {eager:.1f} | {ortrain:.1f} | {ortrain / eager:.2f} |")


if __name__ == "__main__":
    main()
