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


def test_a_guard_that_divides_by_zero_for_an_input_does_not_hold_for_it() -> None:
    """torch writes a guard's conditions in an order of its own: ``2 % (2 * (T // 3)) != 0`` came
    before ``6 <= T``, and a T of 2 raised ZeroDivisionError out of the step (wave 41)."""
    guards = SizeGuards("(2 % (2*(L['t0'].size()[1] // 3))) != 0 and 6 <= L['t0'].size()[1]")
    assert guards([torch.zeros(2, 9, 4)])
    assert not guards([torch.zeros(2, 2, 4)])
