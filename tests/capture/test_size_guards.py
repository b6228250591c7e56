"""Size guards: what a capture with symbolic sizes assumed, as one expression over the inputs."""

from __future__ import annotations

import pickle

import torch
from torch import nn

from ortrain.capture.aot_capture import capture
from ortrain.capture.size_guards import SizeGuards


class _Tupled(nn.Module):
    """The model with the flat-tuple output that ``capture`` takes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(x),)


def test_a_branch_on_a_symbolic_size_becomes_a_guard(truncating_model: type[nn.Module]) -> None:
    model, example = _Tupled(truncating_model()), [torch.randn(2, 12, 4)]
    captured = capture(model, example, training=True, dynamic_dims={0: (1,)})
    guards = captured.size_guards
    assert guards.code is not None and "16" in guards.code
    assert guards([torch.randn(2, 9, 4)]) and guards([torch.randn(3, 16, 4)])
    assert not guards([torch.randn(2, 20, 4)])  # the branch the graph did not take
    assert not guards([torch.randn(2, 1, 4)])  # sizes 0 and 1 are specialized apart


def test_static_captures_assume_nothing_and_guards_survive_pickling(
    truncating_model: type[nn.Module],
) -> None:
    captured = capture(_Tupled(truncating_model()), [torch.randn(2, 12, 4)], training=True)
    assert captured.size_guards.code is None and captured.size_guards([torch.randn(5, 30, 4)])
    dynamic = capture(
        _Tupled(truncating_model()), [torch.randn(2, 12, 4)], training=True, dynamic_dims={0: (1,)}
    )
    copy = pickle.loads(pickle.dumps(dynamic.size_guards))
    assert isinstance(copy, SizeGuards) and copy.code == dynamic.size_guards.code
    assert not copy([torch.randn(2, 20, 4)]) and copy([torch.randn(2, 10, 4)])
