"""Whole-graph ORTModule vs the Dynamo path (graph breaks) on the benchmarks' models.

Competitors, each in a fresh process (interleaved over the repeats; medians reported):

- ``eager``: PyTorch.
- ``ortmodule``: ``ORTModule(model)``, whole-graph capture (its first choice).
- ``dynamo``: ``torch.compile(model, backend="ortrain")``, the path ORTModule switches a model to
  when whole-graph capture fails on data-dependent Python (TorchDynamo's guards every step).

``--break`` adds a ``.item()``-driven ``if`` to each model (a real graph break): ``ortmodule`` then
measures the switch itself (failed whole-graph capture, then Dynamo).

    python benchmarks/bench_graph_breaks.py [--repeats 3] [--steps 20] [--models mlp,gpt] [--break]
    python benchmarks/bench_graph_breaks.py --quick      # proves it runs: mlp, 3 steps, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from ortrain import bench

COMPETITORS = ("eager", "ortmodule", "dynamo")


class WithItemBreak(nn.Module):
    """The model, then a Python ``if`` on a value: whole-graph capture cannot take it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(*args)
        loss = out[1] if isinstance(out, tuple) else out
        if loss.detach().float().abs().mean().item() > 1e9:  # never true; still a graph break
            loss = loss * 0.5
        return out if isinstance(out, tuple) else loss


def run_one(model_name: str, competitor: str, steps: int, with_break: bool) -> dict[str, float]:
    model, batch = bench.build_model(model_name)  # model(*batch) is the loss
    if with_break:
        model = WithItemBreak(model)
    if competitor == "ortmodule":
        from ortrain import ORTModule

        model = ORTModule(model)
    elif competitor == "dynamo":
        import ortrain.backend  # noqa: F401  (registers the name)

        model = torch.compile(model, backend="ortrain")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(*batch).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    rest = times[2:] or times[1:]
    return {"first_s": times[0], "step_ms": statistics.median(rest) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--break", dest="with_break", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "COMPETITOR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.models = 1, 3, "mlp"
    if args.child:
        print(json.dumps(run_one(args.child[0], args.child[1], args.steps, args.with_break)))
        return
    print(
        f"{bench.cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"medians of {args.repeats} runs"
    )
    print(f"{'model':6} {'competitor':10} {'step ms':>9} {'vs eager':>9} {'first s':>8}")
    for model_name in args.models.split(","):
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in COMPETITORS}
        for _ in range(args.repeats):
            for competitor in COMPETITORS:
                command = [
                    sys.executable,
                    __file__,
                    "--steps",
                    str(args.steps),
                    "--child",
                    model_name,
                    competitor,
                ]
                if args.with_break:
                    command.append("--break")
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[competitor].append(json.loads(out.stdout.strip().splitlines()[-1]))
        results = {c: {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]} for c in COMPETITORS}
        eager = results["eager"]
        name = model_name + ("+break" if args.with_break else "")
        for competitor in COMPETITORS:
            r = results[competitor]
            print(
                f"{name:6} {competitor:10} {r['step_ms']:9.1f} {r['step_ms'] / eager['step_ms']:9.2f} "
                f"{r['first_s']:8.2f}"
            )


if __name__ == "__main__":
    main()
