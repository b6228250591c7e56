"""Where ortrain's first step goes: capture, export, passes, session creation, first run.

Each measurement runs in a fresh process (imports cold, as a user's script), for the MLP and the
tiny GPT of ``ortrain bench``; the GPT then runs a second sequence length, which captures a
dynamic graph (the "re-capture" row). With ``--cache`` each model runs twice against one new
``ORTMODULE_CACHE_DIR``: a cold cache, then a warm one.

    python benchmarks/bench_startup.py                # full sizes, uncached
    python benchmarks/bench_startup.py --cache        # cold and warm ORTMODULE_CACHE_DIR
    python benchmarks/bench_startup.py --quick        # tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

# Steps a cold-cache child trains after the measured ones: op tuning finishes within them.
TRAIN_STEPS = 12
# Steps measured together after the first (and the re-capture).
NEXT_STEPS = 3

STAGES = (
    "capture",
    "capture (store)",
    "capture (cached)",
    "partition",
    "export",
    "export (cached)",
    "passes",
    "session",
)


def _child(model_name: str, quick: bool) -> None:
    start = time.perf_counter()
    import torch

    from ortrain import ORTModule, bench
    from ortrain.runtime import startup_timings

    imported = time.perf_counter() - start
    sizes = bench.QUICK if quick else bench.FULL
    model, batch = bench.build_model(model_name, sizes)
    wrapped = ORTModule(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)

    def step(inputs: tuple[torch.Tensor, ...]) -> float:
        began = time.perf_counter()
        loss = wrapped(*inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - began

    rows = []
    phases = [("first step", batch)]
    if model_name == "gpt":
        half = sizes.gpt_seq // 2
        phases.append((f"re-capture (seq {half})", tuple(t[:, :half].contiguous() for t in batch)))
    # Op tuning runs the first calls in PyTorch and builds ONNX Runtime's placement on the third:
    # the steps after the first show where that export went.
    measured = [(label, inputs, 1) for label, inputs in phases]
    measured.append((f"next {NEXT_STEPS} steps, together", batch, NEXT_STEPS))
    for label, inputs, repeats in measured:
        startup_timings.RECORDED.clear()
        total = sum(step(inputs) for _ in range(repeats))
        stages: dict[str, float] = defaultdict(float)
        for timing in startup_timings.RECORDED:
            stages[timing.stage] += timing.seconds
            if timing.stage.startswith("export"):
                stages[f"graph {timing.graph}"] += timing.seconds
        stages["first run"] = total - sum(stages[s] for s in STAGES)
        rows.append({"phase": label, "total": total, "stages": dict(stages)})
    second = rows[-1]["total"] / NEXT_STEPS
    if os.environ.get("ORTMODULE_CACHE_DIR"):
        # Train on, as a run would, until op tuning has chosen and recorded each graph's
        # placement in the cache (the warm process then builds the chosen one alone).
        for i in range(TRAIN_STEPS * len(phases)):
            step(phases[i % len(phases)][1])
    print(json.dumps({"model": model_name, "import": imported, "rows": rows, "second step": second}))


def _run(model_name: str, quick: bool, cache_dir: str | None) -> dict:
    env = dict(os.environ)
    env.pop("ORTMODULE_CACHE_DIR", None)
    if cache_dir:
        env["ORTMODULE_CACHE_DIR"] = cache_dir
    command = [sys.executable, __file__, "--child", model_name] + (["--quick"] if quick else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _format(label: str, result: dict) -> list[str]:
    lines = []
    for row in result["rows"]:
        s = row["stages"]
        export = s.get("export", 0.0) + s.get("export (cached)", 0.0)
        loaded, exported = s.get("export (cached)", 0.0) > 0, s.get("export", 0.0) > 0
        export_label = ("partly loaded" if exported else "loaded") if loaded else ""
        per_graph = ", ".join(
            f"{k.split(' ', 1)[1]} {v:.2f}" for k, v in sorted(s.items()) if k.startswith("graph ")
        )
        # A stored capture is part of the cold capture's cost; a loaded one is "loaded".
        capture = s.get("capture", 0.0) + s.get("capture (store)", 0.0)
        cached = s.get("capture (cached)", 0.0)
        capture_cell = f"{cached:.2f} loaded" if cached and not capture else f"{capture + cached:.2f}"
        if s.get("capture (store)"):
            capture_cell += f" (store {s['capture (store)']:.2f})"
        lines.append(
            f"| {result['model']} | {label} | {row['phase']} | {row['total']:.2f} "
            f"| {capture_cell} | {s.get('partition', 0):.2f} "
            f"| {export:.2f} {export_label} ({per_graph}) "
            f"| {s.get('passes', 0):.2f} | {s.get('session', 0):.2f} "
            f"| {s['first run']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--cache", action="store_true", help="also run with a cold, then a warm cache")
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.quick)
        return
    print(
        "| model | cache | phase | total s | capture | partition | export (per graph) | passes | sessions "
        "| first run |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for model_name in args.models.split(","):
        if args.cache:
            with tempfile.TemporaryDirectory(prefix="ortrain-cache-") as cache_dir:
                for label in ("cold", "warm"):
                    print("\n".join(_format(label, _run(model_name, args.quick, cache_dir))), flush=True)
        else:
            print("\n".join(_format("none", _run(model_name, args.quick, None))), flush=True)


if __name__ == "__main__":
    main()
