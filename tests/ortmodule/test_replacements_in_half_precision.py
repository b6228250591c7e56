"""The capture's own formulations keep eager's dtypes and rounding in half precision: autocast's
float32 list (margin losses), PyTorch's type promotion (copysign), float32 inner math (mish's
backward). Wave 48's review found each computing in bfloat16 where eager does not."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _Head(nn.Module):
    def __init__(self, loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)
        self.loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(self.linear(x))


TARGETS = torch.tensor([1, 0, 4, 2])
LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "multi_margin_loss": lambda h: F.multi_margin_loss(h, TARGETS),
    "multi_margin_loss p=2 weighted": lambda h: F.multi_margin_loss(h, TARGETS, p=2, weight=torch.rand(5)),
    "multilabel_margin_loss": lambda h: F.multilabel_margin_loss(
        h, torch.tensor([[1, 3, -1, 0, 0], [0, -1, 0, 0, 0], [4, 2, 1, -1, 0], [2, 0, 3, 1, 4]])
    ),
    "copysign": lambda h: (torch.copysign(h, torch.randn(5)) * 1.001 + 0.001).float().square().mean(),
    "mish": lambda h: F.mish(h).float().square().mean(),
}


# Mish's forward in float16 is rounded otherwise than PyTorch's kernel (ONNX Runtime's Mish, 2e-4
# here, within float16's rounding), which its gradients inherit: bfloat16 shows its backward.
CASES = [(loss, dtype) for loss in LOSSES for dtype in (torch.bfloat16, torch.float16)]
CASES.remove(("mish", torch.float16))


@pytest.mark.parametrize(("loss", "dtype"), CASES)
def test_under_autocast_loss_dtype_and_gradients_are_eagers(
    loss: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ONNX Runtime's CPU build lacks half-precision Gemm: the default policy runs it in PyTorch.
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    eager = _Head(LOSSES[loss])
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    x = torch.randn(4, 6)
    results = []
    for module in (wrapped, eager):
        torch.manual_seed(1)  # the weights and signs the losses draw
        with torch.autocast("cpu", dtype=dtype):
            value = module(x)
        value.backward()
        results.append(value)
    assert results[0].dtype == results[1].dtype
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad, rtol=1e-5, atol=1e-6)


def test_copysign_promotes_a_float32_magnitude_next_to_a_float64_sign() -> None:
    from ortrain.capture.decompositions_math import copysign

    a, b = torch.randn(3, 4), torch.randn(4, dtype=torch.float64)
    assert copysign(a, b).dtype == torch.copysign(a, b).dtype == torch.float64
    torch.testing.assert_close(copysign(a, b), torch.copysign(a, b), rtol=0, atol=0)
    ints = torch.tensor([-2, 3])
    assert copysign(ints, torch.tensor([1, -1])).dtype == torch.copysign(ints, torch.tensor([1, -1])).dtype
