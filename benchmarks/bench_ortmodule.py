"""Eager vs torch.compile vs ortrain on the MLP, the tiny GPT and the SFT GPT: step time, first step,
peak RSS. The logic is :mod:`ortrain.bench` (the same as ``ortrain bench``); each (model,
competitor, repeat) runs in a fresh process and the table reports medians over the repeats.

    python benchmarks/bench_ortmodule.py [--repeats 3] [--steps 20] [--models mlp,gpt,sft] [--quick]
"""

from __future__ import annotations

import argparse

from ortrain import bench


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default="mlp,gpt,sft")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    env = bench.environment()
    print(f"{env['cpu']}, torch {env['torch']}, {env['threads']} threads, medians of {args.repeats} runs")
    results = bench.run_benchmark(
        args.models.split(","), steps=args.steps, repeats=args.repeats, quick=args.quick
    )
    print("\n".join(bench.format_table(results)))


if __name__ == "__main__":
    main()
