"""ELU, CELU and SELU where ONNX Runtime runs them (ortrain/export/spelled_out_math.py): their
results to an ulp or two of PyTorch's expm1, also where the backward reads the result."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _Activated(nn.Module):
    def __init__(self, activation: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(x * self.scale)


@pytest.mark.parametrize(
    "activation",
    [nn.ELU(), nn.ELU(inplace=True), nn.CELU(1.5, inplace=True), nn.SELU()],
    ids=["elu", "elu inplace", "celu inplace", "selu"],
)
def test_elus_results_and_gradients_are_eagers(
    activation: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wave 47's review: ONNX Runtime's Elu computes exp(x) - 1 (elu(-1e-6) 1.3% off); spelled out
    with Kahan's expm1 everywhere, an inplace ELU's backward, grad * (y + alpha), magnified its
    extra ulp far below 0 to 50% off eager's input gradients."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # ONNX Runtime runs the graphs
    eager = _Activated(activation)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.cat([torch.linspace(-16, 0, 2001), -torch.logspace(-8, -2, 200)])
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    expected, got = eager(inputs[0]), wrapped(inputs[1])
    torch.testing.assert_close(got, expected, rtol=3e-7, atol=0)
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad, rtol=1e-4, atol=1e-7)
