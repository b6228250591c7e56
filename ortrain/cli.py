"""The ``ortrain`` command: ``demo`` trains a small GPT; ``bench`` compares eager, torch.compile and
ortrain; ``doctor`` checks the setup; ``cache`` lists or clears ORTMODULE_CACHE_DIR."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _doctor() -> int:
    from ortrain.doctor import run_doctor

    return 0 if run_doctor(print) else 1


def _bench(args: argparse.Namespace) -> int:
    from ortrain import bench

    models = [m for m in (args.models or ("mlp" if args.quick else "mlp,gpt,sft")).split(",") if m]
    unknown = [m for m in models if m not in bench.BUILTIN_MODELS and ":" not in m]
    if unknown:  # until wave 41 found by a child process, after the models before it had run
        known = ", ".join(bench.BUILTIN_MODELS)
        print(f"unknown model(s) {', '.join(unknown)}: use {known}, or module:factory", file=sys.stderr)
        return 2
    for name in (m for m in models if m not in bench.BUILTIN_MODELS):
        try:  # here, before any model runs, not as a child's traceback
            bench.model_factory(name)
        except bench.ModelFactoryError as error:
            print(error, file=sys.stderr)
            return 2
    steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    env = bench.environment()
    print(
        f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}, onnxruntime {env['onnxruntime']}; "
        f"{steps} steps, medians of {repeats} run(s){', quick sizes' if args.quick else ''}"
    )
    results = bench.run_benchmark(
        models, steps=steps, repeats=repeats, quick=args.quick, report=lambda line: print(line, flush=True)
    )
    print("\n".join(bench.format_table(results)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "ortrain-bench.json", out / "ortrain-bench.png"
    settings = {"models": models, "steps": steps, "repeats": repeats, "quick": args.quick}
    bench.write_json(results, json_path, settings)
    print(f"wrote {json_path}")
    try:
        bench.write_chart(results, png_path)
        print(f"wrote {png_path}")
    except ImportError as error:
        print(f"no chart: {error}")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from ortrain.cache.cache_listing import clear_cache, list_cache
    from ortrain.ortmodule.options import cache_directory

    directory = Path(args.dir) if args.dir else cache_directory()
    if directory is None:
        print("no cache directory: set ORTMODULE_CACHE_DIR or pass --dir", file=sys.stderr)
        return 2
    if not directory.is_dir():
        # A mistyped path said "0 entries" and succeeded until wave 41.
        print(f"{directory} is not a directory: no cache there", file=sys.stderr)
        return 2
    lines = clear_cache(directory) if args.action == "clear" else list_cache(directory)
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # ``ortrain cache list | head``: the reader left; Python's own exit would print a
        # traceback flushing stdout into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="ortrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small GPT on text shipped with ortrain")
    demo.add_argument(
        "--steps",
        type=int,
        default=300,
        help="training steps, with a progress bar (default 300; at least 20: the loss is compared "
        "between the first and the last 10)",
    )
    demo.add_argument(
        "--timing-steps",
        type=int,
        default=30,
        help="steps of ortrain and of eager PyTorch timed after the training, alternated (default 30)",
    )
    bench = commands.add_parser(
        "bench",
        help="eager vs torch.compile vs ortrain: step time and peak memory, each in its own process",
    )
    bench.add_argument(
        "--models",
        help="comma-separated: mlp, gpt, gpt-softmax, gpt-dropout (dropout 0.1), sft (half the labels -100), "
        "lstm, cnn, or "
        "module:factory returning (model, batch) where model(*batch), or model(**batch) for a dict "
        "batch, returns the loss (importable from the working directory) "
        "(default: mlp,gpt,sft; mlp with --quick)",
    )
    bench.add_argument("--steps", type=int, help="timed steps after the first (default 20; 3 with --quick)")
    bench.add_argument(
        "--repeats", type=int, help="processes per competitor, medians (default 3; 1 with --quick)"
    )
    bench.add_argument("--quick", action="store_true", help="tiny models, few steps: checks that it all runs")
    bench.add_argument("--out", default=".", help="directory for ortrain-bench.json and ortrain-bench.png")
    commands.add_parser(
        "doctor", help="versions, usable execution providers, optional extras, a training check"
    )
    cache = commands.add_parser("cache", help="list or clear the graphs kept in ORTMODULE_CACHE_DIR")
    cache.add_argument("action", choices=("list", "clear"))
    cache.add_argument("--dir", help="the cache directory (default: ORTMODULE_CACHE_DIR)")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "timing_steps"):
        value = getattr(args, name, None)
        if value is not None and value < 1:  # a statistics traceback until wave 41
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.command == "demo":
        from ortrain.demo import LOSS_WINDOW, MIN_STEPS

        if args.steps < MIN_STEPS:  # exited 1 without a word until wave 53
            parser.error(
                f"--steps must be at least {MIN_STEPS}: the demo compares the mean loss of the first "
                f"{LOSS_WINDOW} steps with that of the last {LOSS_WINDOW}"
            )
    if args.command == "bench" and args.models is not None and not args.models.strip(","):
        parser.error("--models is empty: name at least one model")
    if args.command == "cache":
        return _cache(args)
    if args.command == "doctor":
        return _doctor()
    if args.command == "bench":
        return _bench(args)
    from ortrain.demo import DemoSettings, run_demo

    result = run_demo(DemoSettings(steps=args.steps, timing_steps=args.timing_steps), report=print)
    if result.last_loss < result.first_loss:
        return 0
    print(
        f"the loss did not go down ({result.first_loss:.3f} -> {result.last_loss:.3f}): ortrain did "
        "not train the model; `ortrain doctor` checks the setup",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
