"""Eager (also under ortrain's malloc settings) vs torch.compile vs ortrain on the MLP, the tiny
GPT (SDPA or spelled-out attention), the SFT GPT, an LSTM tagger and a small ResNet: step time,
first step, peak RSS; then, per model, ortrain's tuned placements, the GEMM speed of both
libraries on the model's shapes, and where ortrain's step goes (ONNX Runtime's profiler by
operator type, PyTorch's regions). The logic is :mod:`ortrain.bench` (the same as ``ortrain
bench``); each (model, competitor, repeat) runs in a fresh process, repeats are interleaved and
the table reports medians over the repeats.

    python benchmarks/bench_ortmodule.py [--repeats 3] [--steps 20] [--quick]
                                         [--models mlp,gpt,gpt-softmax,gpt-dropout,sft,lstm,cnn]
                                         [--competitors eager,eager-malloc,compile,ortrain]
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
    parser.add_argument("--models", default="mlp,gpt,gpt-softmax,sft,lstm,cnn")
    parser.add_argument("--competitors", default=",".join(bench.COMPETITORS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    env = bench.environment()
    print(
        f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}, onnxruntime {env['onnxruntime']}; "
        f"medians of {args.repeats} interleaved runs"
    )
    results = bench.run_benchmark(
        args.models.split(","),
        steps=args.steps,
        repeats=args.repeats,
        quick=args.quick,
        details=True,
        competitors=tuple(args.competitors.split(",")),
    )
    print("\n".join(bench.format_table(results)))
    print("\n".join(bench.format_details(results)))


if __name__ == "__main__":
    main()
