"""Sparse batches: eager vs torch.compile vs ortrain with the sparsity optimizers off and on.

Two workloads, one invocation:

- ``sft``: the tiny GPT (4 layers, d=256, vocab 8000, 8 x 128 tokens) with the first half of
  every sequence's labels set to -100 (a prompt that is not trained on). The training call uses
  the loss only. ortrain runs with ORTMODULE_ENABLE_SPARSE_OPTIMIZER=0 ("dense") and =1
  ("sparse"; with the compute optimizer the LM head then runs on the counted rows).
- ``padded``: a BERT-style masked LM (transformers' BertForMaskedLM, 4 layers, hidden 256,
  8 x 128 tokens) on a right-padded batch at 50% token density with an attention mask, 15% of
  the real tokens labelled. ortrain runs with ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER=0 and =1.

Targets (issue 12): sft sparse <= 0.75x torch.compile and <= 0.85x ortrain dense;
padded with padding elimination <= 0.7x without. Each (workload, competitor) runs in a fresh
process, in interleaved rounds (every competitor once per round, the order rotating), so that a
drift in the machine's load hits all alike; the step is forward + backward + SGD step, median
over the measured steps (for ortrain, those after op tuning has chosen its placements); a ratio is
the median of the per-round ratios.

    python benchmarks/bench_sparsity.py [--steps 20] [--rounds 3] [--workloads sft,padded] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

COMPETITORS = ("eager", "compile", "ortrain-dense", "ortrain-sparse")
_SWITCH = {
    "sft": "ORTMODULE_ENABLE_SPARSE_OPTIMIZER",
    "padded": "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
}


def _build(workload: str, quick: bool) -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]:
    torch.manual_seed(0)
    batch, length = (4, 32) if quick else (8, 128)
    if workload == "sft":
        from ortrain.models.tiny_gpt import GPTConfig, TinyGPT, TinyGPTLoss

        config = (
            GPTConfig(vocab_size=500, block_size=length, n_layer=2, n_head=2, d_model=64)
            if quick
            else GPTConfig(vocab_size=8000, block_size=length, n_layer=4, n_head=4, d_model=256)
        )
        idx = torch.randint(0, config.vocab_size, (batch, length))
        targets = torch.roll(idx, -1, dims=1)
        targets[:, : length // 2] = -100
        return TinyGPTLoss(TinyGPT(config)), (idx, targets), lambda m, b: m(*b)
    import transformers

    hidden = 64 if quick else 256
    config = transformers.BertConfig(
        vocab_size=500 if quick else 8000, hidden_size=hidden, num_hidden_layers=2 if quick else 4,
        num_attention_heads=4, intermediate_size=4 * hidden, max_position_embeddings=length,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    ids = torch.randint(1, config.vocab_size, (batch, length))
    lengths = torch.linspace(0.25, 0.75, batch).mul(length).round().long()  # mean density 50%
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids[mask == 0] = 0
    labels = torch.full_like(ids, -100)
    chosen = (torch.rand(ids.shape) < 0.15) & (mask == 1)
    labels[chosen] = ids[chosen]
    data = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return transformers.BertForMaskedLM(config), data, lambda m, b: m(**b).loss


def run_one(workload: str, competitor: str, steps: int, quick: bool) -> dict[str, float]:
    if competitor.startswith("ortrain"):
        os.environ[_SWITCH[workload]] = "1" if competitor == "ortrain-sparse" else "0"
    model, data, loss_fn = _build(workload, quick)
    if competitor.startswith("ortrain"):
        from ortrain import ORTModule

        model = ORTModule(model)
    elif competitor == "compile":
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, data).backward()
        optimizer.step()

    start = time.perf_counter()
    train_step()
    first_s = time.perf_counter() - start
    if competitor.startswith("ortrain"):
        from ortrain.bench import train_while_tuning

        train_while_tuning(model, train_step)  # op tuning's race is not the step it chooses
    train_step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - start)
    return {"first_s": first_s, "step_ms": statistics.median(times) * 1000}


def _cpu_model() -> str:
    try:
        for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=False
        ).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workloads", default="sft,padded")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all competitors")
    parser.add_argument(
        "--quick", action="store_true", help="small models and 3 steps: checks the script runs"
    )
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "COMPETITOR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    if args.child:
        print(json.dumps(run_one(args.child[0], args.child[1], steps, args.quick)))
        return
    print(f"CPU: {_cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{args.rounds} interleaved rounds, one fresh process per competitor and round; the")
    print("order of the competitors rotates between rounds. Ratios: median of the per-round ratios.")
    print()
    print(
        "| workload | competitor | first step (s) | step ms (median) | per round | vs compile "
        "| vs ortrain without |"
    )
    print("|---|---|---:|---:|---|---:|---:|")
    for workload in args.workloads.split(","):
        rounds = [_round(workload, r, steps, args.quick) for r in range(args.rounds)]
        for competitor in COMPETITORS:
            runs = [r[competitor] for r in rounds if competitor in r]
            if not runs:
                print(f"| {workload} | {competitor} | failed | | | | |")
                continue
            steps_ms = [run["step_ms"] for run in runs]
            first = statistics.median(run["first_s"] for run in runs)
            print(
                f"| {workload} | {competitor} | {first:.1f} | {statistics.median(steps_ms):.1f} | "
                f"{' / '.join(f'{x:.0f}' for x in steps_ms)} | {_ratio(rounds, competitor, 'compile')} | "
                f"{_ratio(rounds, competitor, 'ortrain-dense')} |"
            )


def _round(workload: str, index: int, steps: int, quick: bool) -> dict[str, dict[str, float]]:
    """One run of every competitor, each in a fresh process, starting at a rotating position."""
    order = COMPETITORS[index % len(COMPETITORS) :] + COMPETITORS[: index % len(COMPETITORS)]
    results: dict[str, dict[str, float]] = {}
    for competitor in order:
        command = [sys.executable, __file__, "--child", workload, competitor, "--steps", str(steps)]
        if quick:
            command.append("--quick")
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            failure = done.stderr.strip().splitlines()[-1:]
            print(f"{workload} / {competitor} failed: {failure}", file=sys.stderr)
            continue
        results[competitor] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def _ratio(rounds: list[dict[str, dict[str, float]]], competitor: str, reference: str) -> str:
    both = [r for r in rounds if competitor in r and reference in r]
    ratios = [r[competitor]["step_ms"] / r[reference]["step_ms"] for r in both]
    if not ratios:
        return "n/a"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"


if __name__ == "__main__":
    main()
