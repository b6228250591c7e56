"""Operators users define with ``torch.library.custom_op``, inside a wrapped model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


@torch.library.custom_op("ortrain_tests::double_", mutates_args=("x",))
def _double_(x: torch.Tensor) -> None:
    x.mul_(2)


@_double_.register_fake
def _(x: torch.Tensor) -> None:
    return None


class _DoublesABuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _double_(self.scale)
        return (self.linear(x) * self.scale).square().mean()


def test_an_operator_that_writes_its_argument_and_returns_nothing_is_captured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The memory optimizer costed it by its first argument, the operator itself
    (``auto_functionalized``): the capture failed until wave 43 and the model fell back. The
    operator has no ONNX translation: under the default policy PyTorch runs it alone."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    model = _DoublesABuffer()
    wrapped = ORTModule(copy.deepcopy(model))
    for _ in range(3):
        x = torch.randn(4, 8)
        losses = [m(x) for m in (model, wrapped)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0])
        torch.testing.assert_close(wrapped.scale, model.scale)
        torch.testing.assert_close(wrapped.linear.weight.grad, model.linear.weight.grad)
    assert not wrapped._ortrain_fallback.active
