"""Where the tiny GPT runs under ortrain, per dtype: the share of its FX nodes and of its graphs'
time in each executor (ONNX Runtime, torch, python op), measured over ``--steps`` steps after the
first. Each dtype runs in its own process.

    python benchmarks/bench_placement.py [--dtypes float32,bfloat16] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from ortrain import ORTModule, bench


def placement(dtype_name: str, steps: int) -> dict[str, dict[str, float]]:
    """Nodes and seconds per executor for the tiny GPT under ortrain in ``dtype_name``."""
    model, batch = bench.build_model("gpt")
    wrapped = ORTModule(model.to(getattr(torch, dtype_name)))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        wrapped(*batch).float().backward()
        optimizer.step()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    nodes: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for _, runner in wrapped.graph_runners():
        for name, count in runner.plan.nodes_by_executor().items():
            nodes[name] = nodes.get(name, 0) + count
        runner.profile = seconds
    start = time.perf_counter()
    for _ in range(steps):
        step()
    step_ms = (time.perf_counter() - start) / steps * 1000
    return {"nodes": nodes, "seconds": seconds, "step": {"ms": step_ms, "first_s": first}}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(placement(args.child, args.steps)))
        return
    print(f"CPU: {bench.cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("tiny GPT under ortrain: share of FX nodes / of graph time per executor")
    print(f"{'dtype':9} {'executor':12} {'nodes':>6} {'node %':>7} {'time %':>7}   step ms  first s")
    for dtype_name in args.dtypes.split(","):
        out = subprocess.run(
            [sys.executable, __file__, "--steps", str(args.steps), "--child", dtype_name],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        result = json.loads(out.stdout.strip().splitlines()[-1])
        nodes, seconds, step = result["nodes"], result["seconds"], result["step"]
        total_nodes, total_seconds = sum(nodes.values()), sum(seconds.values()) or 1.0
        for i, name in enumerate(sorted(nodes)):
            tail = f"   {step['ms']:7.1f}  {step['first_s']:7.1f}" if i == 0 else ""
            print(
                f"{dtype_name:9} {name:12} {nodes[name]:6.0f} {100 * nodes[name] / total_nodes:6.1f}% "
                f"{100 * seconds.get(name, 0.0) / total_seconds:6.1f}%{tail}"
            )


if __name__ == "__main__":
    main()
