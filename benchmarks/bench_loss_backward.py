"""The loss backward's memory and time: how much the backward run grows the process, and the step.

The tiny GPT (4 layers, d_model 256, vocab 8000) at sequence 512: the (batch x seq) x vocab
gradient of its cross-entropy is the largest tensor of the backward run. For each competitor, in a
fresh child process, every step resets the kernel's high-water mark (``/proc/self/clear_refs``)
before ``loss.backward()`` and reads it after: the growth is the peak during the backward run less
the resident set before it. Workloads:

- ``lm``: the model returns ``(logits, loss)``, training uses the loss (AOTAutograd then feeds the
  backward a zeros gradient for the logits);
- ``sft``: the loss only, with the first half of every sequence's labels -100 (label sparsity on).

``--checkouts A,B`` runs ortrain from each listed source tree (its root goes first on
``PYTHONPATH``), in turn, ``--repeat`` times, so that two versions are compared in one invocation
(e.g. ``git worktree add /tmp/before <commit>``). ONNX Runtime runs the whole backward graph
(op tuning off: tuning may hand the backward to PyTorch).

    python benchmarks/bench_loss_backward.py [--workload lm|sft] [--batch 4] [--seq 512] [--steps 4]
        [--checkouts .,/tmp/before] [--repeat 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

_ROOT = Path(__file__).resolve().parent.parent


def _status() -> tuple[int, int]:
    """Resident set and its high-water mark, in KiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(rest.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


class _LossOnly(nn.Module):
    """ortrain.models.tiny_gpt.TinyGPTLoss, kept here: --checkouts runs trees older than it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)[1]


def run_child(
    competitor: str, workload: str, batch: int, seq: int, steps: int, quick: bool
) -> dict[str, float]:
    from ortrain.models.tiny_gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    vocab = 500 if quick else 8000
    config = (
        GPTConfig(vocab_size=vocab, block_size=seq, n_layer=2, n_head=2, d_model=64)
        if quick
        else GPTConfig(vocab_size=vocab, block_size=seq, n_layer=4, n_head=4, d_model=256)
    )
    model: nn.Module = TinyGPT(config)
    if workload == "sft":
        model = _LossOnly(model)
    if competitor == "ortrain":
        os.environ["ORTMODULE_ENABLE_TUNING"] = "0"
        from ortrain import ORTModule

        model = ORTModule(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (batch, seq), generator=generator)
    targets = torch.roll(idx, -1, dims=1)
    if workload == "sft":
        targets[:, : seq // 2] = -100
    times, growths = [], []
    for _ in range(steps + 1):  # the first step captures: not counted
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        out = model(idx, targets)
        loss = out if workload == "sft" else out[1]
        before, _ = _status()
        Path("/proc/self/clear_refs").write_text("5")
        loss.backward()
        _, peak = _status()
        del out, loss
        optimizer.step()
        times.append(time.perf_counter() - start)
        growths.append((peak - before) / 1024)
    return {"step_ms": statistics.median(times[1:]) * 1000, "backward_growth_mib": max(growths[1:])}


def _child(competitor: str, checkout: str | None, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", competitor, "--workload", args.workload]
    command += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    command += ["--quick"] if args.quick else []
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(checkout).resolve()), env.get("PYTHONPATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{competitor} ({checkout}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=("lm", "sft"), default="lm")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkouts", default=str(_ROOT), help="comma-separated ortrain source trees")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="small model and 2 steps: checks the script runs"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.seq, args.steps = min(args.seq, 64), 2
    if args.child:
        result = run_child(args.child, args.workload, args.batch, args.seq, args.steps, args.quick)
        print(json.dumps(result))
        return
    load = os.getloadavg()[0]
    print(
        f"CPU: {_cpu_model()}, load {load:.2f}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; "
        f"workload {args.workload}, batch {args.batch}, seq {args.seq}{' (quick)' if args.quick else ''}"
    )
    print("| competitor | round | backward growth MiB | step ms |")
    print("|---|---:|---:|---:|")
    if not args.no_eager:
        eager = _child("eager", None, args)
        print(f"| eager | 1 | {eager['backward_growth_mib']:.1f} | {eager['step_ms']:.1f} |", flush=True)
    for round_ in range(1, args.repeat + 1):
        for checkout in args.checkouts.split(","):
            r = _child("ortrain", checkout, args)
            growth, step = r["backward_growth_mib"], r["step_ms"]
            print(f"| ortrain {checkout} | {round_} | {growth:.1f} | {step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
