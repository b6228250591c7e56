"""``F.one_hot`` of int32 indices and ``index_select`` of int8 ones refused under ORTModule as eager
PyTorch refuses them."""

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


@pytest.fixture(params=[None, "FALLBACK_DISABLE"])
def policy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refusal under the default policy and under FALLBACK_DISABLE."""
    if request.param is None:
        monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    else:
        monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", request.param)


@pytest.mark.usefixtures("policy")
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_one_hot_of_narrow_indices_raises_eagers_error_then_int64_trains(dtype: torch.dtype) -> None:
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


class _Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 3))

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.table.index_select(0, indices).square().mean()


@pytest.mark.usefixtures("policy")
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.bool])
def test_index_select_of_narrow_indices_raises_eagers_error(dtype: torch.dtype) -> None:
    # Wave 49's review: ortrain computed a result where eager refuses.
    torch.manual_seed(0)
    eager = _Lookup()
    wrapped = ORTModule(copy.deepcopy(eager))
    indices = torch.tensor([1, 0, 1])
    for module in (eager, wrapped):
        with pytest.raises(RuntimeError, match=r"index_select\(\): Expected dtype int32 or int64"):
            module(indices.to(dtype))
    for module in (wrapped, eager):
        module(indices.to(torch.int32)).backward()
    torch.testing.assert_close(wrapped.table.grad, eager.table.grad)
    assert not wrapped._ortrain_fallback.active
