"""Gradients at the kinks of piecewise activations, where a translation's < against <= shows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _parity import runs_whole_in_onnxruntime

from ortrain import ORTModule


class _Activation(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x * self.scale)


@pytest.mark.parametrize(
    "fn",
    [F.relu6, F.hardtanh, lambda x: F.hardtanh(x, -2.0, 3.0), F.relu, F.hardsigmoid],
    ids=["relu6", "hardtanh", "hardtanh-2-3", "relu", "hardsigmoid"],
)
def test_gradients_at_the_bounds_are_pytorchs(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """onnxscript's hardtanh_backward compared strictly: relu6 passed the gradient at exactly 0
    and 6, hardtanh at ±1, where PyTorch's is 0 (an input at a bound is common after a ReLU)."""
    x = torch.tensor([-3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 3.0, 6.0])
    grads = []
    for wrap in (False, True):
        module = _Activation(fn)
        model = ORTModule(module) if wrap else module
        xi = x.clone().requires_grad_()
        model(xi).sum().backward()
        grads.append((xi.grad, module.scale.grad))
        if wrap:
            assert all(runs_whole_in_onnxruntime(r) for _, r in model.graph_runners())
    torch.testing.assert_close(grads[1], grads[0])
