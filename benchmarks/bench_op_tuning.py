"""Each placement of op tuning, forced, side by side: step time, ONNX nodes, regions; then what the
tuner itself chooses and what tuning costs (automatic mode, and ORTMODULE_ENABLE_TUNING=1).

Each (placement, repeat) runs in a fresh process; repeats are interleaved; medians. The ONNX node
count is over the ONNX Runtime sessions of the forward and backward graphs (after ortrain's
passes); "regions" counts the steps of the plans, so crossings between executors show there.

    python benchmarks/bench_op_tuning.py [--model gpt] [--repeats 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from ortrain import ORTModule, bench
from ortrain.ortmodule.options import openmp_wait_policy, runtime_options
from ortrain.passes.pipeline import default_passes
from ortrain.runtime.executors.ort import OrtSessionRunner
from ortrain.runtime.graph_executor import build_graph_executor
from ortrain.runtime.placement import Placement

PLACEMENTS = ["onnxruntime", "all-torch", "matmul-in-torch", "fused-in-torch", "fused+matmul-in-torch"]


def _step(model: Any, optimizer: Any, batch: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(*batch).backward()
    optimizer.step()


def forced(model_name: str, placement_name: str, steps: int) -> dict[str, float]:
    """The step time of ``model_name`` with both graphs built under one placement."""
    os.environ["ORTMODULE_ENABLE_TUNING"] = "0"
    model, batch = bench.build_model(model_name)
    wrapped = ORTModule(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    _step(wrapped, optimizer, batch)
    placement = Placement.from_name(placement_name)
    # Built as ORTModule builds its graphs (same opset, passes and options), the placement aside.
    options = runtime_options()
    passes = default_passes(compute_optimizer=options.enable_compute_optimizer)
    onnx_nodes = regions = 0
    build_s = 0.0
    for entries in wrapped._ortrain_graphs.values():
        for entry in entries:
            for name, slot in (("forward", entry.capture.forward), ("backward", entry.capture.backward)):
                start = time.perf_counter()
                slot.runner = build_graph_executor(
                    slot.graph,
                    name=name,
                    opset_version=options.opset_version,
                    passes=passes,
                    saver=None,
                    device=torch.device("cpu"),
                    policy=options.fallback_policy,
                    placement=placement,
                    openmp_passive=openmp_wait_policy() == "PASSIVE",
                    cache_dir=options.cache_dir,
                )
                build_s += time.perf_counter() - start
                regions += len(slot.runner.plan.steps)
                onnx_nodes += sum(
                    len(r.exported.model.graph.node)
                    for r in slot.runner.runners
                    if isinstance(r, OrtSessionRunner)
                )
    _step(wrapped, optimizer, batch)  # warm-up of the new sessions
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(wrapped, optimizer, batch)
        times.append(time.perf_counter() - start)
    return {
        "step_ms": statistics.median(times) * 1000,
        "onnx_nodes": onnx_nodes,
        "regions": regions,
        "build_s": build_s,
    }


def tuned(model_name: str, mode: str, steps: int) -> dict[str, Any]:
    """``mode``: "auto" (the variable unset) or "1"."""
    if mode != "auto":
        os.environ["ORTMODULE_ENABLE_TUNING"] = mode
    result = bench.run_competitor(model_name, "ortrain", steps)
    return {k: result[k] for k in ("step_ms", "first_s", "tuning_s", "tuning_steps", "placements")}


def _child(kind: str, model_name: str, what: str, steps: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "ORTMODULE_ENABLE_TUNING"}
    command = [sys.executable, __file__, "--steps", str(steps), "--child", kind, model_name, what]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {model_name} {what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, model_name, what = args.child
        result = (
            forced(model_name, what, args.steps) if kind == "forced" else tuned(model_name, what, args.steps)
        )
        print(json.dumps(result))
        return
    env = bench.environment()
    print(
        f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}, onnxruntime {env['onnxruntime']}, "
        f"OMP_WAIT_POLICY={openmp_wait_policy() or 'unset'}; "
        f"{bench.MODEL_LABELS.get(args.model, args.model)}, medians of {args.repeats} interleaved runs"
    )
    names = args.placements.split(",")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in [*names, "eager", "auto", "forced"]}
    for _ in range(args.repeats):
        for name in names:
            runs[name].append(_child("forced", args.model, name, args.steps))
        runs["eager"].append(bench.run_competitor(args.model, "eager", args.steps))
        runs["auto"].append(_child("tuned", args.model, "auto", args.steps))
        runs["forced"].append(_child("tuned", args.model, "1", args.steps))
    eager_ms = statistics.median(r["step_ms"] for r in runs["eager"])
    print(f"eager: {eager_ms:.1f} ms a step")
    print("| placement | step ms | vs eager | ONNX nodes | regions | build s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        med = {
            k: statistics.median(r[k] for r in runs[name])
            for k in ("step_ms", "onnx_nodes", "regions", "build_s")
        }
        print(
            f"| {name} | {med['step_ms']:.1f} | {med['step_ms'] / eager_ms:.2f} | {med['onnx_nodes']:.0f} "
            f"| {med['regions']:.0f} | {med['build_s']:.1f} |"
        )
    for mode in ("auto", "forced"):
        med = {
            k: statistics.median(r[k] for r in runs[mode]) for k in ("step_ms", "tuning_s", "tuning_steps")
        }
        chosen = "; ".join(str(r["placements"]) for r in runs[mode])
        print(
            f"tuning {mode}: {med['step_ms']:.1f} ms a step after tuning "
            f"({med['step_ms'] / eager_ms:.2f}x eager); tuning took {med['tuning_s']:.1f} s "
            f"over {med['tuning_steps']:.0f} steps; chose {chosen}"
        )


if __name__ == "__main__":
    main()
