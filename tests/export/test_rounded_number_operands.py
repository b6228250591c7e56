"""A Python number compared with, or taken as a remainder against, a float16 or bfloat16 tensor is
rounded to the tensor's dtype first, as PyTorch does: ``x_bf16 >= 1000.3`` is True at 1000, and
``x_bf16 % 0.3`` divides by 0.30078125 (the translations used the exact number: wave 48's review)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.export.rounded_number_operands import round_number_operands


class _ComparedWithNumbers(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scaled = x * self.scale
        h = scaled.to(self.dtype)
        flags = torch.stack([h >= 1000.3, h < 1000.3, h == 1001, h != 1000.3, h > 0.3, h <= 0.7])
        remainders = torch.stack([h % 0.3, h.remainder(1.7), torch.remainder(0.7, h.detach())])
        return scaled.sum(), flags, remainders


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_comparisons_and_remainders_round_their_numbers_as_eager(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)  # half-precision Mul: PyTorch's
    eager = _ComparedWithNumbers(dtype)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.tensor([1000.0, 1001.0, 3.0, 0.25, 0.3, 7.0])
    for expected, got in zip(eager(x), wrapped(x), strict=True):
        torch.testing.assert_close(got, expected, rtol=0.0, atol=0.0)


def test_only_half_precision_operands_and_inexact_numbers_are_rewritten() -> None:
    def f(h: torch.Tensor, f32: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return h >= 1000.3, h % 0.5, f32 >= 1000.3, torch.remainder(0.3, h)

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))
    assert round_number_operands(gm) == 2
    numbers = [n.args for n in gm.graph.nodes if n.op == "call_function"]
    assert (numbers[0][1], numbers[1][1], numbers[2][1], numbers[3][0]) == (1000.0, 0.5, 1000.3, 0.30078125)


class _Clipped(nn.Module):
    def __init__(self, dtype: torch.dtype, values: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(values, dtype=dtype))

    def forward(self) -> torch.Tensor:
        return nn.functional.hardtanh(self.w, -0.7, 0.7).float().sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_hardtanh_compares_with_its_bounds_unrounded_as_eagers_kernel(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    # The regression review: hardtanh's backward (ortrain's decomposition) compared in half
    # precision, so the rounding above moved its bound to 0.69921875 and blocked the gradient
    # there, where PyTorch's kernel compares in float32 with 0.7.
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    held = torch.tensor(0.7, dtype=dtype).item()
    eager = _Clipped(dtype, [held, -held, held / 2, 0.8])
    wrapped = ORTModule(copy.deepcopy(eager))
    eager().backward()
    wrapped().backward()
    torch.testing.assert_close(wrapped.w.grad, eager.w.grad, rtol=0.0, atol=0.0)
