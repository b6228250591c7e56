"""A float16 or bfloat16 tensor multiplied or divided by a number from an open size is computed in
float32 on that number, as PyTorch's CPU kernels do: ``h * (T * 10000)`` at 90 000 was ``inf``
in a float16 graph (NaN loss and gradients), and bfloat16 held it as 90 112."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _ScaledBySize(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x) * 1e-4
        grown = (h * (x.shape[0] * 10000)).sum()  # 90 000 and more: beyond float16's 65504
        shrunk = (h / (x.shape[0] * 0.37)).sum()
        return grown.float() * 1e-3 + shrunk.float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_half_precision_tensor_times_a_large_size_number_is_eager(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    # The CPU provider has no half-precision Gemm or Mul: the default policy runs those in PyTorch.
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    torch.manual_seed(0)
    eager = _ScaledBySize(dtype)
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (8, 9, 10):  # the second size captures with the batch left open
        x = torch.randn(rows, 8, dtype=dtype)
        expected, got = eager(x), wrapped(x)
        expected.backward()
        got.backward()
        assert torch.isfinite(got), f"{rows} rows: {got.item()}"
        torch.testing.assert_close(got, expected, rtol=0.0, atol=0.0)
        torch.testing.assert_close(wrapped.linear.weight.grad, eager.linear.weight.grad, rtol=0.0, atol=0.0)
        eager.zero_grad()
        wrapped.zero_grad()
