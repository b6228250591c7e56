"""Eager vs torch.compile vs ortrain on the MLP and the tiny GPT: step time, first step, peak RSS.

Each (model, competitor, repeat) runs in a fresh process, so that peak RSS belongs to that
competitor alone; the table reports medians over the repeats.

    python benchmarks/bench_ortmodule.py [--repeats 3] [--steps 20] [--models mlp,gpt]

``--placement float32,bfloat16`` reports instead where the tiny GPT runs under ortrain in each
dtype: the share of its forward and backward FX nodes, and of the graphs' time, in each executor
(ONNX Runtime, torch, python op), measured over ``--steps`` steps after the first.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

COMPETITORS = ("eager", "compile", "ortrain")


def _build(model_name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    torch.manual_seed(0)
    if model_name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        data = (torch.randn(64, 1024), torch.randn(64, 1024))

        def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(m(x), y)

        return model, data, loss_fn
    from ortrain.models.tiny_gpt import GPTConfig, TinyGPT

    config = GPTConfig(vocab_size=8000, block_size=128, n_layer=4, n_head=4, d_model=256)
    model = TinyGPT(config)
    idx = torch.randint(0, 8000, (8, 128))
    data = (idx, torch.roll(idx, -1, dims=1))

    def gpt_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return m(x, y)[1]

    return model, data, gpt_loss


def run_one(model_name: str, competitor: str, steps: int) -> dict[str, float]:
    model, data, loss_fn = _build(model_name)
    if competitor == "ortrain":
        from ortrain import ORTModule

        model = ORTModule(model)
    elif competitor == "compile":
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, *data).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"first_s": times[0], "step_ms": statistics.median(times[2:]) * 1000, "peak_mib": peak_kib / 1024}


def placement(dtype_name: str, steps: int) -> dict[str, dict[str, float]]:
    """Nodes and seconds per executor for the tiny GPT under ortrain in ``dtype_name``."""
    from ortrain import ORTModule

    model, data, loss_fn = _build("gpt")
    wrapped = ORTModule(model.to(getattr(torch, dtype_name)))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped, *data).float().backward()
        optimizer.step()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    runners = [
        slot.runner
        for entries in wrapped._ortrain_graphs.values()
        for entry in entries
        for slot in (entry.capture.forward, entry.capture.backward)
        if slot is not None
    ]
    nodes: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for runner in runners:
        for name, count in runner.plan.nodes_by_executor().items():
            nodes[name] = nodes.get(name, 0) + count
        runner.profile = seconds
    start = time.perf_counter()
    for _ in range(steps):
        step()
    step_ms = (time.perf_counter() - start) / steps * 1000
    return {"nodes": nodes, "seconds": seconds, "step": {"ms": step_ms, "first_s": first}}


def _print_placement(dtypes: str, steps: int) -> None:
    print("tiny GPT under ortrain: share of FX nodes / of graph time per executor")
    print(f"{'dtype':9} {'executor':12} {'nodes':>6} {'node %':>7} {'time %':>7}   step ms  first s")
    for dtype_name in dtypes.split(","):
        out = subprocess.run(
            [sys.executable, __file__, "--steps", str(steps), "--placement-child", dtype_name],
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--placement", metavar="DTYPES", help="e.g. float32,bfloat16: where the GPT runs")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "COMPETITOR"), help=argparse.SUPPRESS)
    parser.add_argument("--placement-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.placement_child:
        print(json.dumps(placement(args.placement_child, args.steps)))
        return
    print(f"CPU: {_cpu_model()}")
    if args.placement:
        _print_placement(args.placement, args.steps)
        return
    if args.child:
        print(json.dumps(run_one(args.child[0], args.child[1], args.steps)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.repeats} runs")
    print(
        f"{'model':6} {'competitor':10} {'step ms':>9} {'vs eager':>9} {'first s':>8} "
        f"{'peak MiB':>9} {'vs eager':>9}"
    )
    for model_name in args.models.split(","):
        results: dict[str, dict[str, float]] = {}
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in COMPETITORS}
        for _ in range(args.repeats):
            for competitor in COMPETITORS:  # interleaved, so drift in machine load hits all alike
                out = subprocess.run(
                    [sys.executable, __file__, "--steps", str(args.steps), "--child", model_name, competitor],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                runs[competitor].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for competitor in COMPETITORS:
            done = runs[competitor]
            results[competitor] = {k: statistics.median(r[k] for r in done) for k in done[0]}
        eager = results["eager"]
        for competitor in COMPETITORS:
            r = results[competitor]
            print(
                f"{model_name:6} {competitor:10} {r['step_ms']:9.1f} {r['step_ms'] / eager['step_ms']:9.2f} "
                f"{r['first_s']:8.2f} {r['peak_mib']:9.0f} {r['peak_mib'] / eager['peak_mib']:9.2f}"
            )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
