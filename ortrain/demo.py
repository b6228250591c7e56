"""The demo: train a small character-level GPT on text shipped with ortrain, on ONNX Runtime.

Shows a progress bar with the loss, then times the same model's training step in eager PyTorch
and under ORTModule side by side.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import torch
from tqdm import tqdm

from ortrain.models.tiny_gpt import GPTConfig, TinyGPT
from ortrain.ortmodule import ORTModule

# The loss is reported as the mean of the first and of the last this many steps.
LOSS_WINDOW = 10
# Fewer steps and the two windows overlap: a shorter run could not show the loss going down
# (until wave 53 `ortrain demo --steps 5` exited 1 without a word).
MIN_STEPS = 2 * LOSS_WINDOW


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 300
    # Big enough for the step to be dominated by compute: on a 0.4M-parameter model (d_model 128,
    # block 64) ortrain's fixed cost per step made it 1.2-1.3x slower than eager.
    batch_size: int = 8
    block_size: int = 128
    d_model: int = 256
    n_layer: int = 2
    n_head: int = 4
    lr: float = 3e-3
    timing_steps: int = 30
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < MIN_STEPS:
            raise ValueError(
                f"the demo trains at least {MIN_STEPS} steps (the loss is compared between the first "
                f"and the last {LOSS_WINDOW}), not {self.steps}"
            )
        if self.timing_steps < 1:
            raise ValueError(f"the demo times at least 1 step, not {self.timing_steps}")


@dataclass(frozen=True)
class DemoResult:
    first_loss: float
    last_loss: float
    capture_seconds: float
    ort_step_ms: float
    eager_step_ms: float


def load_corpus() -> str:
    return resources.files("ortrain.data").joinpath("tiny_corpus.txt").read_text(encoding="utf-8")


class CharBatches:
    """Random windows of the corpus as (input, next-character target) pairs."""

    def __init__(self, text: str, block_size: int, batch_size: int, seed: int) -> None:
        self.vocab = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        last_start = len(self.data) - self.block_size - 1
        starts = torch.randint(0, last_start, (self.batch_size,), generator=self.generator)
        x = torch.stack([self.data[s : s + self.block_size] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + 1 + self.block_size] for s in starts.tolist()])
        return x, y


def _step_times_ms(models: list[torch.nn.Module], batches: CharBatches, steps: int, lr: float) -> list[float]:
    """Median step time of each model, their steps alternated on the same batches so that a
    change in the machine's load (a shared machine's neighbours) hits them alike."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in models]
    times: list[list[float]] = [[] for _ in models]
    for _ in range(steps):
        x, y = batches()
        for model, optimizer, measured in zip(models, optimizers, times, strict=True):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            optimizer.step()
            measured.append(time.perf_counter() - start)
    return [statistics.median(t) * 1000 for t in times]


def run_demo(settings: DemoSettings, report: Callable[[str], None]) -> DemoResult:
    torch.manual_seed(settings.seed)
    batches = CharBatches(load_corpus(), settings.block_size, settings.batch_size, settings.seed)
    config = GPTConfig(
        vocab_size=len(batches.vocab),
        block_size=settings.block_size,
        n_layer=settings.n_layer,
        n_head=settings.n_head,
        d_model=settings.d_model,
    )
    eager_twin = TinyGPT(config)
    model = ORTModule(copy.deepcopy(eager_twin))
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    report(
        f"Training a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter GPT on "
        f"{len(batches.data)} characters with ORTModule ({settings.steps} steps)"
    )
    losses: list[float] = []
    capture_seconds = 0.0
    with tqdm(range(settings.steps), desc="ortrain", unit="step") as bar:
        for step in bar:
            x, y = batches()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, y)[1]
            loss.backward()
            optimizer.step()
            if step == 0:
                capture_seconds = time.perf_counter() - start
            losses.append(loss.item())
            # Every step (until wave 53 every tenth); shown at the bar's own refresh rate.
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    first = statistics.mean(losses[:LOSS_WINDOW])
    last = statistics.mean(losses[-LOSS_WINDOW:])
    report(f"loss {first:.3f} -> {last:.3f} (mean of the first and last {LOSS_WINDOW} steps)")
    # With automatic op tuning the first steps run in PyTorch and ONNX Runtime's placement is built
    # on the fourth (ortrain.runtime.placement_tuning); with tuning off the first step builds it.
    report(f"first step (capture; ONNX Runtime's build unless op tuning defers it): {capture_seconds:.1f} s")
    # The same weights on both sides: trained weights run at another speed than fresh ones (values
    # that drift toward zero become subnormal, slow on the CPU), which a comparison must not measure.
    eager_twin.load_state_dict(model.state_dict())
    report(f"timing {settings.timing_steps} more steps of each, alternated, same weights and batches ...")
    ort_ms, eager_ms = _step_times_ms([model, eager_twin], batches, settings.timing_steps, settings.lr)
    report(
        f"median step: ortrain {ort_ms:.1f} ms, eager PyTorch {eager_ms:.1f} ms "
        f"(ortrain/eager = {ort_ms / eager_ms:.2f})"
    )
    return DemoResult(first, last, capture_seconds, ort_ms, eager_ms)
