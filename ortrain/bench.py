"""Side-by-side training benchmark: eager PyTorch, ``torch.compile`` and ortrain.

Each (model, competitor, repeat) runs in a fresh Python process, so that its peak RSS belongs to
that competitor alone and no competitor inherits another's warm caches; repeats are interleaved so
that drift in machine load hits all competitors alike, and the table reports medians.

Models: ``mlp``, ``gpt`` (a tiny GPT, next-token loss), ``sft`` (the same GPT with half of the
labels ``-100``, as in supervised fine-tuning where the prompt is not scored), or a user's
``module:factory``. The factory takes no argument and returns ``(model, batch)``: ``batch`` is a
tuple of positional arguments or a dict of keyword arguments, and ``model(*batch)`` /
``model(**batch)`` returns the loss (a scalar tensor, or an object with a ``loss`` attribute or key).

``ortrain bench`` (see :mod:`ortrain.cli`) and ``benchmarks/bench_ortmodule.py`` both run this.
"""

from __future__ import annotations

import importlib
import json
import logging
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ortrain.runtime.cpu import cpu_name

logger = logging.getLogger("ortrain.bench")

COMPETITORS = ("eager", "compile", "ortrain")
COMPETITOR_LABELS = {"eager": "eager", "compile": "torch.compile", "ortrain": "ortrain"}
BUILTIN_MODELS = ("mlp", "gpt", "sft")
MODEL_LABELS = {"mlp": "MLP", "gpt": "tiny GPT", "sft": "SFT GPT"}

Batch = tuple[Any, ...] | dict[str, Any]


@dataclass(frozen=True)
class ModelSizes:
    """Sizes of the built-in models; ``QUICK`` is small enough for a test."""

    mlp_width: int = 1024
    mlp_layers: int = 4
    mlp_batch: int = 64
    gpt_layers: int = 4
    gpt_d_model: int = 256
    gpt_heads: int = 4
    gpt_seq: int = 128
    gpt_batch: int = 8
    gpt_vocab: int = 8000


FULL = ModelSizes()
QUICK = ModelSizes(
    mlp_width=64, mlp_layers=2, mlp_batch=8, gpt_layers=1, gpt_d_model=32, gpt_heads=2, gpt_seq=16,
    gpt_batch=2, gpt_vocab=100,
)  # fmt: skip


@dataclass
class BenchResult:
    model: str
    competitor: str
    step_ms: float
    first_s: float
    peak_mib: float
    runs: list[dict[str, float]] = field(default_factory=list)


class _LossOf(nn.Module):
    """Adapts the built-in models to ``model(*batch) -> loss``."""

    def __init__(self, model: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model, *batch)


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(idx, targets)[1]


def build_model(name: str, sizes: ModelSizes = FULL) -> tuple[nn.Module, Batch]:
    """``(model, batch)`` for a built-in model name or a ``module:factory``; seeded, so every
    process builds the same weights and data."""
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(sizes.mlp_layers):
            layers += [nn.Linear(sizes.mlp_width, sizes.mlp_width), nn.ReLU()]
        data = (torch.randn(sizes.mlp_batch, sizes.mlp_width), torch.randn(sizes.mlp_batch, sizes.mlp_width))
        return _LossOf(nn.Sequential(*layers[:-1]), _mse), data
    if name in ("gpt", "sft"):
        from ortrain.models.tiny_gpt import GPTConfig, TinyGPT

        config = GPTConfig(
            vocab_size=sizes.gpt_vocab,
            block_size=sizes.gpt_seq,
            n_layer=sizes.gpt_layers,
            n_head=sizes.gpt_heads,
            d_model=sizes.gpt_d_model,
        )
        idx = torch.randint(0, sizes.gpt_vocab, (sizes.gpt_batch, sizes.gpt_seq))
        targets = torch.roll(idx, -1, dims=1)
        if name == "sft":
            targets[:, : sizes.gpt_seq // 2] = -100  # the prompt half is not scored
        return _LossOf(TinyGPT(config), _gpt_loss), (idx, targets)
    if ":" not in name:
        known = ", ".join(BUILTIN_MODELS)
        raise ValueError(f"unknown model {name!r}: use one of {known}, or module:factory")
    module_name, factory_name = name.split(":", 1)
    factory = getattr(importlib.import_module(module_name), factory_name)
    model, batch = factory()
    if not isinstance(model, nn.Module) or not isinstance(batch, (tuple, list, dict)):
        raise TypeError(
            f"{name} must return (nn.Module, tuple or dict of inputs), got {type(model).__name__}"
        )
    return model, tuple(batch) if isinstance(batch, list) else batch


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(f"the model returned {type(output).__name__}; the benchmark needs a loss tensor")


def run_competitor(
    model_name: str, competitor: str, steps: int, sizes: ModelSizes = FULL
) -> dict[str, float]:
    """Train ``steps + 1`` SGD steps in this process; the first step (capture, compile) is timed
    apart. Returns ``first_s``, ``step_ms`` (median of the steady steps) and ``peak_mib``."""
    model, batch = build_model(model_name, sizes)
    if competitor == "ortrain":
        from ortrain import ORTModule

        model = ORTModule(model)
    elif competitor == "compile":
        model = torch.compile(model)  # type: ignore[assignment]
    elif competitor != "eager":
        raise ValueError(f"unknown competitor {competitor!r}: use one of {', '.join(COMPETITORS)}")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        output = model(**batch) if isinstance(batch, dict) else model(*batch)
        _loss_of(output).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    steady = times[2:] or times[1:]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"first_s": times[0], "step_ms": statistics.median(steady) * 1000, "peak_mib": peak_kib / 1024}


def _child_command(model_name: str, competitor: str, steps: int, quick: bool) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "ortrain.bench",
        "--child",
        model_name,
        competitor,
        "--steps",
        str(steps),
    ]
    return command + (["--quick"] if quick else [])


def run_benchmark(
    models: list[str],
    *,
    steps: int = 20,
    repeats: int = 3,
    quick: bool = False,
    competitors: tuple[str, ...] = COMPETITORS,
    report: Callable[[str], None] = lambda line: None,
) -> list[BenchResult]:
    """Run every (model, competitor) ``repeats`` times, each in its own process; medians."""
    results = []
    for model_name in models:
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in competitors}
        for _ in range(repeats):
            for competitor in competitors:  # interleaved
                report(f"running {model_name} / {COMPETITOR_LABELS[competitor]} ...")
                done = subprocess.run(
                    _child_command(model_name, competitor, steps, quick), capture_output=True, text=True
                )
                if done.returncode != 0:
                    raise RuntimeError(
                        f"{model_name} / {competitor} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
                    )
                runs[competitor].append(json.loads(done.stdout.strip().splitlines()[-1]))
        for competitor in competitors:
            measured = runs[competitor]
            medians = {key: statistics.median(run[key] for run in measured) for key in measured[0]}
            results.append(BenchResult(model_name, competitor, runs=measured, **medians))
    return results


def _ratio(value: float, reference: BenchResult | None, key: str) -> str:
    if reference is None:
        return "-"
    return f"{value / getattr(reference, key):.2f}"


def format_table(results: list[BenchResult]) -> list[str]:
    """A Markdown table: step time and peak RSS, each with ratios to eager and to torch.compile."""
    header = "| model | competitor | step ms | vs eager | vs compile | first step s | peak RSS MiB "
    lines = [header + "| vs eager | vs compile |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        same = {x.competitor: x for x in results if x.model == r.model}
        eager, compiled = same.get("eager"), same.get("compile")
        label = MODEL_LABELS.get(r.model, r.model)
        lines.append(
            f"| {label} | {COMPETITOR_LABELS[r.competitor]} | {r.step_ms:.1f} "
            f"| {_ratio(r.step_ms, eager, 'step_ms')} "
            f"| {_ratio(r.step_ms, compiled, 'step_ms')} | {r.first_s:.2f} | {r.peak_mib:.0f} "
            f"| {_ratio(r.peak_mib, eager, 'peak_mib')} | {_ratio(r.peak_mib, compiled, 'peak_mib')} |"
        )
    return lines


def environment() -> dict[str, Any]:
    import onnxruntime

    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def write_json(results: list[BenchResult], path: Path, settings: dict[str, Any]) -> None:
    payload = {"environment": environment(), "settings": settings, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


MATPLOTLIB_MISSING = 'the PNG chart needs matplotlib: pip install "ortrain[bench]"'


def write_chart(results: list[BenchResult], path: Path) -> None:
    """Step time and peak RSS per competitor, grouped by model. Raises ImportError without
    matplotlib (message: :data:`MATPLOTLIB_MISSING`)."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(MATPLOTLIB_MISSING) from error
    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    competitors = [c for c in COMPETITORS if any(r.competitor == c for r in results)]
    width = 0.8 / max(len(competitors), 1)
    figure, axes = plt.subplots(1, 2, figsize=(4 + 2.5 * len(models), 4))
    for axis, key, title in ((axes[0], "step_ms", "step time (ms)"), (axes[1], "peak_mib", "peak RSS (MiB)")):
        for i, competitor in enumerate(competitors):
            values = [
                next((getattr(r, key) for r in results if r.model == m and r.competitor == competitor), 0.0)
                for m in models
            ]
            positions = [m + (i - (len(competitors) - 1) / 2) * width for m in range(len(models))]
            axis.bar(positions, values, width, label=COMPETITOR_LABELS[competitor])
        axis.set_xticks(range(len(models)), [MODEL_LABELS.get(m, m) for m in models])
        axis.set_title(title)
    axes[0].legend()
    figure.suptitle(f"ortrain bench: {cpu_name()}, {torch.get_num_threads()} threads", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _child_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ortrain.bench")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "COMPETITOR"), required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = run_competitor(args.child[0], args.child[1], args.steps, QUICK if args.quick else FULL)
    print(json.dumps(result))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
