"""Average pooling in bfloat16/float16 trains as eager PyTorch does, bit for bit, past the length
where half precision stops holding integers exactly (wave 54: window positions were built in the
input's dtype, so from position 256 (bfloat16) or 2048 (float16) windows of 3 were divided by 2 or 4)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _ScaledPool(nn.Module):
    def __init__(self, length: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(length, dtype=dtype))
        self.pool = nn.AvgPool1d(3, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x * self.scale)


@pytest.mark.parametrize(("dtype", "length"), [(torch.bfloat16, 600), (torch.float16, 2300)])
def test_long_average_pooling_matches_eager_bit_for_bit(
    dtype: torch.dtype, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ONNX Runtime's CPU provider has no half Mul: that one op runs in PyTorch; the pooling in ONNX.
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    torch.manual_seed(0)
    eager = _ScaledPool(length, dtype)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 3, length).to(dtype)
    grad = torch.randn(2, 3, length - 2).to(dtype)
    results = []
    for model in (eager, wrapped):
        inputs = x.clone().requires_grad_()
        out = model(inputs)
        out.backward(grad)
        results.append((out, inputs.grad))
    (want, want_grad), (got, got_grad) = results
    assert torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)
