"""Adaptive pooling over a length the graph leaves open gives PyTorch's answers at every length
(wave 37: the captured graph was right, its ONNX export kept the windows of one length)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _Pooled(nn.Module):
    def __init__(self, pool: str) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_first = (x * self.scale).t()[None]  # [1, 6, length]
        if self.pool == "max":
            return F.adaptive_max_pool1d(channels_first, 3)
        return F.adaptive_avg_pool2d(channels_first[None], (2, 3))


@pytest.mark.parametrize("pool", ["max", "average"])
def test_every_length_pools_as_in_eager(pool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Max: the widest window is a ceiling, ``-((-2 * n) // 3)``, and onnxscript translates a floor
    division of sizes as ONNX's truncating Div, so the windows were one element too narrow at every
    length but the first (export/size_floor_division.py). Average: the decomposition the export
    inlines is traced at one length; that node now runs in PyTorch (runtime/ort_kernel_limits.py)."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the average pooling runs in PyTorch, warned
    torch.manual_seed(0)
    eager = _Pooled(pool)
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (5, 5, 8, 11, 4, 7):
        x = torch.randn(length, 6)
        got, expected = wrapped(x), eager(x)
        torch.testing.assert_close(got, expected, msg=lambda m, n=length: f"length {n}: {m}")
        got.square().sum().backward()
        expected.square().sum().backward()
    torch.testing.assert_close(wrapped.module.scale.grad, eager.scale.grad)
    assert not wrapped._ortrain_fallback.active
