"""Side-by-side training benchmark: eager PyTorch (also under the malloc settings ortrain makes,
``eager-malloc``), ``torch.compile`` and ortrain.

Each (model, competitor, repeat) runs in a fresh Python process, so that its peak RSS belongs to
that competitor alone and no competitor inherits another's warm caches; repeats are interleaved so
that drift in machine load hits all competitors alike, and the table reports medians.

Models: ``mlp``, ``gpt`` (a tiny GPT, next-token loss), ``gpt-softmax`` (the same GPT with
attention spelled out: matmul, mask, softmax, matmul), ``gpt-dropout`` (the tiny GPT with
dropout 0.1, as Hugging Face's models train), ``sft`` (the tiny GPT with half of the
labels ``-100``, as in supervised fine-tuning where the prompt is not scored), ``lstm`` (a
2-layer LSTM tagger), ``cnn`` (a small ResNet on 32 × 32 images), or a user's ``module:factory``.
The factory takes no argument and returns ``(model, batch)``: ``batch`` is a
tuple of positional arguments or a dict of keyword arguments, and ``model(*batch)`` /
``model(**batch)`` returns the loss (a scalar tensor, or an object with a ``loss`` attribute or key).

``ortrain bench`` (see :mod:`ortrain.cli`) and ``benchmarks/bench_ortmodule.py`` both run this.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ortrain.inspector.memory_stats import process_memory_mib
from ortrain.runtime.cpu import cpu_name

logger = logging.getLogger("ortrain.bench")

# "eager-malloc": eager PyTorch under the malloc settings ortrain makes (freed memory kept for
# reuse, ortrain.runtime.freed_memory_reuse), so that the table shows what of ortrain's step is the
# allocator's and what its graphs'.
COMPETITORS = ("eager", "eager-malloc", "compile", "ortrain")
COMPETITOR_LABELS = {
    "eager": "eager",
    "eager-malloc": "eager, ortrain's malloc",
    "compile": "torch.compile",
    "ortrain": "ortrain",
}
BUILTIN_MODELS = ("mlp", "gpt", "gpt-softmax", "gpt-dropout", "sft", "lstm", "cnn")
MODEL_LABELS = {
    "mlp": "MLP",
    "gpt": "tiny GPT",
    "gpt-softmax": "GPT, spelled-out attention",
    "gpt-dropout": "GPT, dropout 0.1",
    "sft": "SFT GPT",
    "lstm": "LSTM tagger",
    "cnn": "small ResNet",
}
# ortrain's steps before the timed ones may include op tuning; it ends within this many.
MAX_TUNING_STEPS = 60

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
    lstm_width: int = 256
    lstm_seq: int = 64
    lstm_batch: int = 16
    cnn_width: int = 32
    cnn_batch: int = 32


FULL = ModelSizes()
QUICK = ModelSizes(
    mlp_width=64, mlp_layers=2, mlp_batch=8, gpt_layers=1, gpt_d_model=32, gpt_heads=2, gpt_seq=16,
    gpt_batch=2, gpt_vocab=100, lstm_width=16, lstm_seq=6, lstm_batch=2, cnn_width=4, cnn_batch=2,
)  # fmt: skip


@dataclass
class BenchResult:
    model: str
    competitor: str
    step_ms: float
    first_s: float
    peak_mib: float
    runs: list[dict[str, Any]] = field(default_factory=list)
    # ortrain only: median tuning time, the per-step breakdown of one extra run, and the GEMM
    # speed of both libraries on the model's matrix shapes.
    tuning_s: float | None = None
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    profiled_step_ms: float | None = None  # the step of the run that measured the breakdown
    gemm_gflops: dict[str, float] = field(default_factory=dict)


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
    if name in ("gpt", "gpt-softmax", "gpt-dropout", "sft"):
        from ortrain.models.tiny_gpt import GPTConfig, TinyGPT, TinyGPTLoss

        config = GPTConfig(
            vocab_size=sizes.gpt_vocab,
            block_size=sizes.gpt_seq,
            n_layer=sizes.gpt_layers,
            n_head=sizes.gpt_heads,
            d_model=sizes.gpt_d_model,
            attention="softmax" if name == "gpt-softmax" else "sdpa",
            # As Hugging Face's GPT-2 and BERT train: after the embeddings, each attention
            # projection and each MLP (9 dropouts).
            dropout=0.1 if name == "gpt-dropout" else 0.0,
        )
        idx = torch.randint(0, sizes.gpt_vocab, (sizes.gpt_batch, sizes.gpt_seq))
        targets = torch.roll(idx, -1, dims=1)
        if name == "sft":
            targets[:, : sizes.gpt_seq // 2] = -100  # the prompt half is not scored
        return TinyGPTLoss(TinyGPT(config)), (idx, targets)
    if name == "lstm":
        from ortrain.models.lstm_tagger import LSTMTagger

        tokens = torch.randint(0, 1000, (sizes.lstm_batch, sizes.lstm_seq))
        tags = torch.randint(0, 20, (sizes.lstm_batch, sizes.lstm_seq))
        return LSTMTagger(width=sizes.lstm_width), (tokens, tags)
    if name == "cnn":
        from ortrain.models.small_resnet import SmallResNet

        images = torch.randn(sizes.cnn_batch, 3, 32, 32)
        return SmallResNet(sizes.cnn_width), (images, torch.randint(0, 10, (sizes.cnn_batch,)))
    if ":" not in name:
        known = ", ".join(BUILTIN_MODELS)
        raise ValueError(f"unknown model {name!r}: use one of {known}, or module:factory")
    model, batch = model_factory(name)()
    if not isinstance(model, nn.Module) or not isinstance(batch, (tuple, list, dict)):
        raise TypeError(
            f"{name} must return (nn.Module, tuple or dict of inputs), got {type(model).__name__}"
        )
    return model, tuple(batch) if isinstance(batch, list) else batch


class ModelFactoryError(LookupError):
    """A ``module:factory`` model whose module does not import or has no such factory."""


def model_factory(name: str) -> Callable[[], Any]:
    """The factory a ``module:factory`` name names. A module that does not import, or has no such
    factory, is a :class:`ModelFactoryError` saying so in one line (until wave 53 a child's
    traceback, after the models before it had run)."""
    module_name, _, factory_name = name.partition(":")
    if not module_name or not factory_name:
        raise ModelFactoryError(f"{name}: name a module and its factory, module:factory")
    try:
        module = _import_as_children_do(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        itself = missing == module_name or module_name.startswith(f"{missing}.")
        why = "" if itself else f" (it imports {missing!r}, which is not installed)"
        raise ModelFactoryError(
            f"{name}: cannot import module {module_name!r}{why}; it must be importable from the "
            f"working directory ({os.getcwd()}) or be installed"
        ) from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelFactoryError(
            f"{name}: module {module_name!r} ({getattr(module, '__file__', None) or 'no file'}) has no "
            f"factory {factory_name!r}; name a function of it that returns (model, batch)"
        )
    return factory


def _import_as_children_do(module_name: str) -> Any:
    """The module of a ``module:factory`` model, found from the working directory as the
    children (``python -m ortrain.bench``) find it: the parent, run as ``python
    benchmarks/bench_ortmodule.py`` from the repository root, has ``benchmarks/`` on its path
    instead, and failed on ``benchmarks.hf_models`` after every child had run (wave 50)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        here = os.getcwd()
        if error.name is None or not module_name.startswith(error.name) or here in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(module_name)


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(f"the model returned {type(output).__name__}; the benchmark needs a loss tensor")


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    output = model(**batch) if isinstance(batch, dict) else model(*batch)
    _loss_of(output).backward()
    optimizer.step()


def train_while_tuning(model: nn.Module, train_step: Callable[[], None]) -> int:
    """Train an ``ORTModule`` until op tuning has chosen every graph's placement (at most
    ``MAX_TUNING_STEPS``): steps timed after it measure the chosen placements, not the race.
    Returns the number of steps trained."""
    steps = 0
    while steps < MAX_TUNING_STEPS and any(g["tuning"] for g in model.op_tuning()):  # type: ignore[operator]
        train_step()
        steps += 1
    return steps


def run_competitor(
    model_name: str, competitor: str, steps: int, sizes: ModelSizes = FULL, *, breakdown: bool = False
) -> dict[str, Any]:
    """Train SGD steps in this process: the first (capture, compile) is timed apart; for ortrain,
    the steps that tune its placement (:mod:`ortrain.runtime.placement_tuning`) are counted and
    timed apart too; then ``steps`` steady steps. Returns ``first_s``, ``step_ms`` (median of the
    steady steps), ``faults`` and ``system_ms`` (minor page faults and system time per steady
    step), ``peak_mib``, and for ortrain ``tuning_steps``, ``tuning_s`` and
    ``placements``; with ``breakdown`` (ortrain only), ``breakdown_ms``: per step, the time of
    each ONNX operator type inside ONNX Runtime and of the regions PyTorch runs."""
    model, batch = build_model(model_name, sizes)
    if competitor == "ortrain":
        from ortrain import ORTModule

        model = ORTModule(model)
    elif competitor == "compile":
        model = torch.compile(model)  # type: ignore[assignment]
    elif competitor == "eager-malloc":
        # Not through ortrain.ortmodule, whose import (AOTAutograd, TorchDynamo: ≈ 120 MiB) would
        # count in this competitor's peak.
        from ortrain.runtime.freed_memory_reuse import reuse_freed_memory

        reuse_freed_memory(True, users_setting=None)
    elif competitor != "eager":
        raise ValueError(f"unknown competitor {competitor!r}: use one of {', '.join(COMPETITORS)}")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    _train_step(model, optimizer, batch)
    result: dict[str, Any] = {"first_s": time.perf_counter() - start}
    if competitor == "ortrain":
        start = time.perf_counter()
        result["tuning_steps"] = train_while_tuning(model, lambda: _train_step(model, optimizer, batch))
        result["tuning_s"] = time.perf_counter() - start
        result["placements"] = {g["graph"]: g["placement"] for g in model.op_tuning()}  # type: ignore[operator]
    _train_step(model, optimizer, batch)  # warm: a placement chosen at the last step runs once
    if breakdown:
        seconds = _profile_executors(model)
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        start = time.perf_counter()
        _train_step(model, optimizer, batch)
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    result["step_ms"] = statistics.median(times) * 1000
    # Minor page faults and system time per steady step: what the malloc settings change
    # (ortrain.runtime.freed_memory_reuse, benchmarks/bench_freed_memory.py).
    result["faults"] = (after.ru_minflt - before.ru_minflt) / steps
    result["system_ms"] = (after.ru_stime - before.ru_stime) * 1000 / steps
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child started by a large
    # driver reported at least the driver's size at the fork (every MLP competitor read 611 MiB).
    result["peak_mib"] = process_memory_mib()[1]
    if breakdown:
        from ortrain.runtime import ort_profile

        times_us = ort_profile.operator_times(skip_runs=2)  # the first step and the warm one
        per_step = {f"onnxruntime {op}": us / 1000 / steps for op, us in times_us.items()}
        per_step.update(
            {f"{name} (regions)": s * 1000 / steps for name, s in seconds.items() if name != "onnxruntime"}
        )
        result["breakdown_ms"] = dict(sorted(per_step.items(), key=lambda kv: -kv[1]))
    return result


def _profile_executors(model: nn.Module) -> dict[str, float]:
    """Seconds per executor over the following steps (the runners of ortrain's graphs add to it)."""
    seconds: dict[str, float] = {}
    for _, runner in model.graph_runners():  # type: ignore[operator]
        runner.profile = seconds
    return seconds


def _child_command(
    model_name: str, competitor: str, steps: int, quick: bool, breakdown: bool = False
) -> list[str]:
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
    return command + (["--quick"] if quick else []) + (["--breakdown"] if breakdown else [])


def _run_child(command: list[str], what: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_benchmark(
    models: list[str],
    *,
    steps: int = 20,
    repeats: int = 3,
    quick: bool = False,
    competitors: tuple[str, ...] = COMPETITORS,
    report: Callable[[str], None] = lambda line: None,
    details: bool = False,
) -> list[BenchResult]:
    """Run every (model, competitor) ``repeats`` times, each in its own process; medians.

    Each ortrain run tunes on its own (its choices go to a results file of its own). With
    ``details``: the GEMM speed of both libraries on each model's shapes, and one more ortrain
    run, with the last run's placements and ONNX Runtime's profiler on, for the per-op breakdown.
    """
    results = []
    with tempfile.TemporaryDirectory(prefix="ortrain-bench-") as scratch:
        for model_name in models:
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in competitors}
            env = dict(os.environ)
            for repeat in range(repeats):
                for competitor in competitors:  # interleaved
                    report(f"running {model_name} / {COMPETITOR_LABELS[competitor]} ...")
                    env["ORTMODULE_TUNING_RESULTS_PATH"] = str(Path(scratch) / f"{model_name}-{repeat}.json")
                    command = _child_command(model_name, competitor, steps, quick)
                    runs[competitor].append(_run_child(command, f"{model_name} / {competitor}", env))
            for competitor in competitors:
                measured = runs[competitor]
                medians = {
                    k: statistics.median(run[k] for run in measured)
                    for k in ("step_ms", "first_s", "peak_mib")
                }
                result = BenchResult(model_name, competitor, runs=measured, **medians)
                if competitor == "ortrain":
                    result.tuning_s = statistics.median(run["tuning_s"] for run in measured)
                    if details:
                        report(f"profiling {model_name} / ortrain, measuring GEMM speed ...")
                        command = _child_command(model_name, competitor, steps, quick, breakdown=True)
                        profiled = _run_child(command, f"{model_name} / ortrain profile", env)
                        result.breakdown_ms = profiled["breakdown_ms"]
                        result.profiled_step_ms = profiled["step_ms"]
                        result.gemm_gflops = _gemm_speed(model_name, QUICK if quick else FULL)
                results.append(result)
    return results


def _gemm_speed(model_name: str, sizes: ModelSizes) -> dict[str, float]:
    from ortrain.gemm_speed import gemm_gflops, product_shapes

    model, batch = build_model(model_name, sizes)

    def step() -> None:
        output = model(**batch) if isinstance(batch, dict) else model(*batch)
        _loss_of(output).backward()

    return gemm_gflops(product_shapes(step))


def format_details(results: list[BenchResult], *, top: int = 8) -> list[str]:
    """Per model: ortrain's placements and tuning time, GEMM speed of both libraries, and where
    ortrain's step goes (the ``top`` biggest items)."""
    lines = []
    for r in results:
        if r.competitor != "ortrain" or not r.runs:
            continue
        label = MODEL_LABELS.get(r.model, r.model)
        placements = ", ".join(f"{g} {p}" for g, p in r.runs[-1].get("placements", {}).items())
        lines.append(f"{label}: ortrain placements {placements or 'untuned'}; tuning {r.tuning_s or 0:.1f} s")
        if r.gemm_gflops:
            lines.append(
                f"  GEMM on its shapes: torch {r.gemm_gflops['torch']:.1f} GFLOP/s, "
                f"onnxruntime {r.gemm_gflops['onnxruntime']:.1f} GFLOP/s"
            )
        if r.breakdown_ms:
            items = list(r.breakdown_ms.items())
            shown = ", ".join(f"{name} {ms:.1f}" for name, ms in items[:top])
            rest = sum(ms for _, ms in items[top:])
            # The profiled run's own step, beside the unprofiled median, shows what profiling
            # added (the kernels' sum should be close to it).
            profiled = f" (profiled step {r.profiled_step_ms:.1f} ms)" if r.profiled_step_ms else ""
            lines.append(f"  ortrain ms per step{profiled}: {shown}, other {rest:.1f}")
    return lines


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
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.breakdown:
        from ortrain.runtime.ort_profile import profiling

        with tempfile.TemporaryDirectory(prefix="ortrain-profile-") as directory, profiling(Path(directory)):
            result = run_competitor(args.child[0], args.child[1], args.steps, sizes, breakdown=True)
    else:
        result = run_competitor(args.child[0], args.child[1], args.steps, sizes)
    print(json.dumps(result))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
