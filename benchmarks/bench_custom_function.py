"""Custom ``torch.autograd.Function`` as a PythonOp: the tiny GPT with its GELU as a Function.

Both variants train under ortrain: the built-in ``nn.GELU`` (traced into ONNX) and a GELU written
as a ``torch.autograd.Function`` (run by PyTorch between ONNX Runtime segments). The target is a
step time within 10% of the built-in one. Rounds alternate between the variants so that drift in
the machine's speed hits both alike; the table shows the median step time.

The run repeats in two processes: with the default OpenMP wait policy, and with
``OMP_WAIT_POLICY=PASSIVE``. PyTorch's OpenMP threads spin for a while after each PyTorch op; a
Function run by PyTorch between two ONNX Runtime segments leaves them spinning on the cores
ONNX Runtime's next kernels need, which the passive policy avoids.

    python benchmarks/bench_custom_function.py [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT


class GeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x)


class CustomGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GeluFunction.apply(x)


def build(custom: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=8000, block_size=128, n_layer=4, n_head=4, d_model=256)
    model = TinyGPT(config)
    if custom:
        for block in model.blocks:
            block.mlp[1] = CustomGelu()
    wrapped = ORTModule(model)
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-3)


def step(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: tuple[torch.Tensor, torch.Tensor]
) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(*data)[1].backward()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:
        for policy in ("", "PASSIVE"):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            print(f"== OMP_WAIT_POLICY={policy or '(default)'}", flush=True)
            command = [
                sys.executable,
                __file__,
                "--child",
                "--rounds",
                str(args.rounds),
                "--steps",
                str(args.steps),
            ]
            subprocess.run(command, env=env, check=True)
        return
    idx = torch.randint(0, 8000, (8, 128), generator=torch.Generator().manual_seed(0))
    data = (idx, torch.roll(idx, -1, dims=1))
    variants = {"nn.GELU": build(custom=False), "GELU Function": build(custom=True)}
    for name, (model, optimizer) in variants.items():
        first = step(model, optimizer, data)  # capture + export
        step(model, optimizer, data)
        print(f"{name}: first step {first:.1f} s")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (model, optimizer) in variants.items():
            times[name] += [step(model, optimizer, data) for _ in range(args.steps)]
    base = statistics.median(times["nn.GELU"])
    print(f"{'variant':<16}{'median step ms':>16}{'ratio':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<16}{median * 1000:>16.1f}{median / base:>8.3f}")


if __name__ == "__main__":
    main()
