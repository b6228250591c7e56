"""``F.one_hot`` of int32 indices refused under ORTModule as eager PyTorch refuses it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _OneHotHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.fc(F.one_hot(indices, 5).float()).square().mean()


@pytest.mark.parametrize("policy", [None, "FALLBACK_DISABLE"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_one_hot_of_narrow_indices_raises_eagers_error_then_int64_trains(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, policy: str | None
) -> None:
    if policy is None:
        monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    else:
        monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", policy)
    torch.manual_seed(0)
    eager = _OneHotHead()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    indices = torch.tensor([1, 4, 0, 2])
    with pytest.raises(RuntimeError, match="one_hot is only applicable to index tensor of type LongTensor"):
        eager(indices.to(dtype))
    with pytest.raises(RuntimeError, match="one_hot is only applicable to index tensor of type LongTensor"):
        wrapped(indices.to(dtype))
    for module in (wrapped, eager):
        module(indices).backward()
    torch.testing.assert_close(model.fc.weight.grad, eager.fc.weight.grad)
    torch.testing.assert_close(model.fc.bias.grad, eager.fc.bias.grad)
    assert len(wrapped._ortrain_graphs) == 1
