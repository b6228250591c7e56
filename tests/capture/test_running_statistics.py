"""Which inputs of a captured graph only batch norms' statistics updates write (their version
counters are kept, as after eager's kernel), and which other writes still move them."""

from __future__ import annotations

import torch
from torch import nn

from ortrain.capture.aot_capture import Capture, capture


class _Flat(nn.Module):
    """A BatchNorm called twice, a buffer a user's code writes, and a BatchNorm whose running mean
    the forward writes itself before the norm (eager's ``add_`` moves that counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.BatchNorm1d(4)
        self.edited = nn.BatchNorm1d(4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        h = self.twice(self.twice(x))
        self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        self.edited.running_mean.add_(1.0)
        h = self.edited(h)
        return (h * self.ema,)


def _kept(captured: Capture) -> set[str]:
    return {captured.state_names[i] for i in captured.running_statistics}


def test_only_inputs_that_batch_norms_alone_write_are_kept() -> None:
    captured = capture(_Flat(), [torch.randn(6, 4)], training=True)
    assert _kept(captured) == {"twice.running_mean", "twice.running_var", "edited.running_var"}


def test_the_call_keeps_those_counters_and_moves_the_others() -> None:
    model = _Flat()
    captured = capture(model, [torch.randn(6, 4)], training=True)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    state = [tensors[name] for name in captured.state_names]
    before = {n: t._version for n, t in zip(captured.state_names, state, strict=True)}
    with captured.statistics_versions_kept(state, []):
        captured(state, [torch.randn(6, 4)])
    moved = {n for n, t in zip(captured.state_names, state, strict=True) if t._version != before[n]}
    assert moved == {
        "ema",
        "edited.running_mean",
        "twice.num_batches_tracked",
        "edited.num_batches_tracked",
    }
