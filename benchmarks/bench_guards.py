"""What ORTModule's per-step guard costs: the walk over the model and the graph lookup, against a step.

The guard (flatten the inputs, read every parameter, buffer, submodule flag and hook, build the
graph key, find the graph) runs before every forward. This times it alone, many times over, and
a whole training step (forward, backward, SGD) for comparison; medians.

    python benchmarks/bench_guards.py [--models mlp,gpt,gpt2] [--steps 20]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line)
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def _build(name: str) -> tuple[nn.Module, tuple, dict, Callable[[object], torch.Tensor]]:
    """The model, the arguments of one call, and how to get the loss from its output."""
    torch.manual_seed(0)
    if name == "mlp":  # the MLP of bench_ortmodule.py
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())][:-1])
        target = torch.randn(64, 1024)
        return model, (torch.randn(64, 1024),), {}, lambda out: F.mse_loss(out, target)
    if name == "gpt":  # the tiny GPT of bench_ortmodule.py
        from ortrain.models.tiny_gpt import GPTConfig, TinyGPT

        model = TinyGPT(GPTConfig(vocab_size=8000, block_size=128, n_layer=4, n_head=4, d_model=256))
        idx = torch.randint(0, 8000, (8, 128))
        return model, (idx, torch.roll(idx, -1, dims=1)), {}, lambda out: out[1]
    # A Hugging Face GPT-2 with 12 layers: many more modules and tensors per step to walk.
    import transformers

    config = transformers.GPT2Config(
        n_layer=12, n_embd=128, n_head=4, vocab_size=2000, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 2000, (4, 64))
    return model, (), {"input_ids": ids, "labels": ids}, lambda out: out.loss


def measure(name: str, steps: int) -> dict[str, float]:
    model, args, kwargs, loss_of = _build(name)
    wrapped = ORTModule(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    step_times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_of(wrapped(*args, **kwargs)).backward()
        optimizer.step()
        step_times.append(time.perf_counter() - start)
    cache = wrapped._ortrain_graphs
    guard_times = []
    for _ in range(200):
        start = time.perf_counter()
        call, _state, key = wrapped._guard(args, kwargs)
        entry = cache.lookup(key, lambda e, inputs=call.inputs: e.matches(inputs))
        guard_times.append(time.perf_counter() - start)
        assert entry is not None, "the guard missed a graph it should find"
    return {
        "modules": len(list(model.modules())),
        "tensors": len(list(model.parameters())) + len(list(model.buffers())),
        "guard_us": statistics.median(guard_times) * 1e6,
        "step_ms": statistics.median(step_times[2:]) * 1e3,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", default="mlp,gpt,gpt2")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"{_cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':6} {'modules':>8} {'tensors':>8} {'guard µs':>9} {'step ms':>8} {'guard/step':>11}")
    for name in args.models.split(","):
        r = measure(name, args.steps)
        share = r["guard_us"] / 1e3 / r["step_ms"]
        counts = f"{r['modules']:8d} {r['tensors']:8d}"
        print(f"{name:6} {counts} {r['guard_us']:9.1f} {r['step_ms']:8.1f} {share:11.3%}")


if __name__ == "__main__":
    main()
