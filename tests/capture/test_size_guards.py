"""Size guards: what a capture with symbolic sizes assumed, as one expression over the inputs."""

from __future__ import annotations

import pickle

import torch
from torch import nn

from ortrain.capture.aot_capture import capture
from ortrain.capture.size_guards import SizeGuards


class _Truncating(nn.Module):
    """Keeps at most 16 positions: a branch on a size, which tracing decides once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        if x.shape[1] > 16:
            x = x[:, :16]
        return (self.proj(x).mean(),)


def test_a_branch_on_a_symbolic_size_becomes_a_guard() -> None:
    captured = capture(_Truncating(), [torch.randn(2, 12, 4)], training=True, dynamic_dims={0: (1,)})
    guards = captured.size_guards
    assert guards.code is not None and "16" in guards.code
    assert guards([torch.randn(2, 9, 4)]) and guards([torch.randn(3, 16, 4)])
    assert not guards([torch.randn(2, 20, 4)])  # the branch the graph did not take
    assert not guards([torch.randn(2, 1, 4)])  # sizes 0 and 1 are specialized apart


def test_static_captures_assume_nothing_and_guards_survive_pickling() -> None:
    captured = capture(_Truncating(), [torch.randn(2, 12, 4)], training=True)
    assert captured.size_guards.code is None and captured.size_guards([torch.randn(5, 30, 4)])
    dynamic = capture(_Truncating(), [torch.randn(2, 12, 4)], training=True, dynamic_dims={0: (1,)})
    copy = pickle.loads(pickle.dumps(dynamic.size_guards))
    assert isinstance(copy, SizeGuards) and copy.code == dynamic.size_guards.code
    assert not copy([torch.randn(2, 20, 4)]) and copy([torch.randn(2, 10, 4)])
