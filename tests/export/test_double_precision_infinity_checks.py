"""``isinf``, ``isposinf`` and ``isneginf`` of float64 values beyond float32's range are False, as in
eager: onnxscript checked them after a cast to float32, where -1e300 is -inf, and the attention
math form zeroed a query row masked with ``torch.finfo(torch.float64).min`` (wave 49's review)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTModule


class _Checks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * self.scale
        flags = torch.stack([torch.isinf(h), torch.isposinf(h), torch.isneginf(h)])
        return torch.where(torch.isneginf(h), 0.0, h).sum(), flags


def test_float64_values_beyond_float32_are_not_infinite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    eager = _Checks()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.tensor([-1e300, 1e300, -torch.inf, torch.inf, 1.0], dtype=torch.float64)
    for expected, got in zip(eager(x), wrapped(x), strict=True):
        torch.testing.assert_close(got, expected, rtol=0.0, atol=0.0)


class _MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 12, dtype=torch.float64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_row_masked_with_float64_min_attends_as_in_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _MaskedAttention()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    mask = torch.zeros(3, 3, dtype=torch.float64)
    mask[1] = torch.finfo(torch.float64).min  # query 1 sees no key: eager averages the values
    expected, got = eager(x, mask), wrapped(x, mask)
    torch.testing.assert_close(got, expected)
    expected.pow(2).sum().backward()
    got.pow(2).sum().backward()
    torch.testing.assert_close(wrapped.proj.weight.grad, eager.proj.weight.grad)
