"""First step of eager PyTorch, ``torch.compile`` and ortrain, each with its caches cold and warm.

Every run is a fresh Python process (imports cold, as a user's training script) that builds the
model, wraps it and its optimizer ("setup"), and trains two SGD steps. Per model and
competitor there are two runs against one new, empty cache directory: "cold" (the directory is
empty) and "warm" (the second process finds what the first stored):

- eager: no cache; the second run shows the spread between two identical processes;
- torch.compile: its own on-disk caches (Inductor's FX graph cache, AOTAutograd's cache, Triton's
  kernels) in ``TORCHINDUCTOR_CACHE_DIR``;
- ortrain: ``ORTMODULE_CACHE_DIR``.

"cold" means the tools' caches are empty, not the operating system's file cache: the libraries
themselves are read from memory after the first run.

    python benchmarks/bench_first_step.py            # MLP and tiny GPT, full sizes
    python benchmarks/bench_first_step.py --quick    # tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

COMPETITORS = ("eager", "compile", "ortrain")
LABELS = {"eager": "eager", "compile": "torch.compile", "ortrain": "ortrain", "mlp": "MLP", "gpt": "tiny GPT"}


def _child(model_name: str, competitor: str, quick: bool) -> None:
    start = time.perf_counter()
    import torch

    from ortrain import bench

    if competitor == "ortrain":
        from ortrain import ORTModule
    imported = time.perf_counter()
    model, batch = bench.build_model(model_name, bench.QUICK if quick else bench.FULL)
    if competitor == "ortrain":
        model = ORTModule(model)
    elif competitor == "compile":
        model = torch.compile(model)  # type: ignore[assignment]
    # Building the first optimizer imports torch._dynamo (seconds): every competitor pays it.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ready = time.perf_counter()
    ends = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(*batch).backward()
        optimizer.step()
        ends.append(time.perf_counter())
    timings = {
        "import_s": imported - start,
        "setup_s": ready - imported,
        "first_s": ends[0] - ready,
        "to_first_s": ends[0] - start,
        "second_ms": (ends[1] - ends[0]) * 1000,
    }
    print(json.dumps(timings))


def _environment(competitor: str, cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("ORTMODULE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    if competitor == "compile":
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
        env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    elif competitor == "ortrain":
        env["ORTMODULE_CACHE_DIR"] = cache_dir
    return env


def _run(model_name: str, competitor: str, quick: bool, cache_dir: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", model_name, competitor] + (["--quick"] if quick else [])
    done = subprocess.run(
        command, env=_environment(competitor, cache_dir), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} / {competitor} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--competitors", default=",".join(COMPETITORS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.quick)
        return
    from ortrain.bench import cpu_name

    print(f"CPU: {cpu_name()}; {os.cpu_count()} cores; {'quick' if args.quick else 'full'} sizes\n")
    print("| model | competitor | cache | import s | setup s | first step s | total s | 2nd step ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for model_name in args.models.split(","):
        for competitor in args.competitors.split(","):
            with tempfile.TemporaryDirectory(prefix=f"first-step-{competitor}-") as cache_dir:
                for label in ("cold", "warm"):
                    r = _run(model_name, competitor, args.quick, cache_dir)
                    cache = ("none" if label == "cold" else "none, again") if competitor == "eager" else label
                    print(
                        f"| {LABELS[model_name]} | {LABELS[competitor]} | {cache} | {r['import_s']:.2f} "
                        f"| {r['setup_s']:.2f} | {r['first_s']:.2f} | {r['to_first_s']:.2f} "
                        f"| {r['second_ms']:.1f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
