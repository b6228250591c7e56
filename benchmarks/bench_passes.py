"""What each graph pass is worth: ortrain's training step with the default passes against the same
model with one pass left out, in ONE process, steps interleaved (A B B A ...), so that the machine's
drift hits both alike. Prints, per model and left-out pass, the ONNX node count of each graph (after
the passes, before ONNX Runtime's own fusions), by operator type where it differs, and the median
step of each variant with the median of the per-round ratios.

Op tuning is off (ORTMODULE_ENABLE_TUNING=0): the passes act on the graphs ONNX Runtime runs, and
a tuner choosing PyTorch for a graph would hide them.

    python benchmarks/bench_passes.py [--models gpt,gpt-softmax,mlp] [--steps 20] [--quick]
                                      [--without rewrite_loss_head_gradient,...] [--kernel-time]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

from ortrain import ORTModule, bench
from ortrain.ortmodule import ortmodule as ortmodule_module
from ortrain.passes import pipeline
from ortrain.runtime import ort_profile
from ortrain.runtime.cpu import cpu_name

Counts = dict[str, collections.Counter[str]]


def _build(
    model_name: str, sizes: bench.ModelSizes, without: str | None, profile_dir: Path | None
) -> tuple[ORTModule, object, Counts, list[object]]:
    """An ORTModule whose passes leave out ``without``; its graphs' op counts fill in at capture.
    With ``profile_dir``, its sessions record their kernels (returned, to be read apart)."""
    counts: Counts = {}

    def passes(*, compute_optimizer: bool) -> list[tuple[str, pipeline.Pass]]:
        chosen = [p for p in pipeline.default_passes(compute_optimizer=compute_optimizer) if p[0] != without]

        def record(model: onnx.ModelProto) -> onnx.ModelProto:
            graph = "backward" if "forward" in counts else "forward"
            counts[graph] = collections.Counter(node.op_type for node in model.graph.node)
            return model

        return [*chosen, ("count", record)]

    model, batch = bench.build_model(model_name, sizes)
    original: Callable[..., list[tuple[str, pipeline.Pass]]] = ortmodule_module.default_passes
    ortmodule_module.default_passes = passes  # read once, at capture (the first step)
    try:
        wrapped = ORTModule(model)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
        with ort_profile.profiling(profile_dir) if profile_dir else contextlib.nullcontext():
            bench._train_step(wrapped, optimizer, batch)
    finally:
        ortmodule_module.default_passes = original
    return wrapped, (optimizer, batch), counts, list(ort_profile.take_tracked()) if profile_dir else []


def _step(wrapped: ORTModule, state: object) -> float:
    optimizer, batch = state  # type: ignore[misc]
    start = time.perf_counter()
    bench._train_step(wrapped, optimizer, batch)
    return time.perf_counter() - start


def _print_kernel_times(sessions_a: list[object], sessions_b: list[object], steps: int) -> None:
    """ONNX Runtime's kernel time per step of each variant, and what changed by operator type."""
    # The first step (capture) and the two warm-up steps are left out.
    kernel_a = ort_profile.operator_times(skip_runs=3, sessions=sessions_a)  # type: ignore[arg-type]
    kernel_b = ort_profile.operator_times(skip_runs=3, sessions=sessions_b)  # type: ignore[arg-type]
    total_a, total_b = (sum(k.values()) / 1e3 / steps for k in (kernel_a, kernel_b))
    deltas = {op: (kernel_a[op] - kernel_b[op]) / 1e3 / steps for op in set(kernel_a) | set(kernel_b)}
    change = {op: round(d, 2) for op, d in sorted(deltas.items(), key=lambda kv: kv[1]) if abs(d) >= 0.1}
    print(
        f"  ONNX Runtime kernel ms per step without {total_b:.1f}, with {total_a:.1f}"
        f" (ratio {total_a / max(total_b, 1e-9):.3f}); change by op type (ms): {change}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="gpt,gpt-softmax,mlp")
    parser.add_argument("--steps", type=int, default=20, help="interleaved rounds (one step of each)")
    parser.add_argument(
        "--without", default="rewrite_loss_head_gradient", help="passes to leave out, one at a time"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument(
        "--kernel-time",
        action="store_true",
        help="also ONNX Runtime's kernel time per step of each variant (its profiler): work counted, "
        "less sensitive to other processes than the step's wall-clock time",
    )
    args = parser.parse_args()
    os.environ["ORTMODULE_ENABLE_TUNING"] = "0"
    sizes = bench.QUICK if args.quick else bench.FULL
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; medians of {args.steps} interleaved rounds")
    for model_name in args.models.split(","):
        for without in args.without.split(","):
            profile_root = Path(tempfile.mkdtemp(prefix="bench_passes_")) if args.kernel_time else None
            with_pass, state_a, counts_a, sessions_a = _build(
                model_name, sizes, None, profile_root / "with" if profile_root else None
            )
            no_pass, state_b, counts_b, sessions_b = _build(
                model_name, sizes, without, profile_root / "without" if profile_root else None
            )
            for _ in range(2):  # warm-up
                _step(with_pass, state_a), _step(no_pass, state_b)
            times_a, times_b = [], []
            for round_ in range(args.steps):
                if round_ % 2:
                    times_b.append(_step(no_pass, state_b))
                    times_a.append(_step(with_pass, state_a))
                else:
                    times_a.append(_step(with_pass, state_a))
                    times_b.append(_step(no_pass, state_b))
            print(f"{model_name}, all passes vs without {without}:")
            for graph in ("forward", "backward"):
                a, b = counts_a.get(graph, collections.Counter()), counts_b.get(graph, collections.Counter())
                diff = {op: a[op] - b[op] for op in sorted(set(a) | set(b)) if a[op] != b[op]}
                print(f"  {graph} nodes {sum(b.values())} -> {sum(a.values())}; by op type: {diff or 'same'}")
            ratio = statistics.median(x / y for x, y in zip(times_a, times_b, strict=True))
            median_a, median_b = statistics.median(times_a) * 1e3, statistics.median(times_b) * 1e3
            print(
                f"  step ms without {median_b:.1f}, with {median_a:.1f}; median per-round ratio {ratio:.3f}"
            )
            if profile_root:
                _print_kernel_times(sessions_a, sessions_b, args.steps)


if __name__ == "__main__":
    main()
