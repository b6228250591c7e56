"""Memoized helpers in the forward (ortrain/capture/memoized_functions.py)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.capture.memoized_functions import memoized_functions_unwrapped


@functools.lru_cache(maxsize=8)
def _causal_mask(length: int) -> torch.Tensor:
    return torch.triu(torch.ones(length, length), 1).bool()


class _MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)

    @functools.cache  # noqa: B019 - memoized per instance and length, as such code does
    def _slopes(self, heads: int) -> torch.Tensor:
        return torch.linspace(0.5, 1.0, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ x.transpose(1, 2)
        scores = scores.masked_fill(_causal_mask(x.shape[1]), float("-inf")) * self._slopes(1)
        return scores.softmax(-1).pow(2).sum()


def test_memoized_helpers_run_unwrapped_meanwhile_and_are_put_back() -> None:
    before = (_causal_mask, vars(_MaskedAttention)["_slopes"])
    with memoized_functions_unwrapped([_MaskedAttention]):
        assert globals()["_causal_mask"] is before[0].__wrapped__
        assert vars(_MaskedAttention)["_slopes"] is before[1].__wrapped__
    assert (_causal_mask, vars(_MaskedAttention)["_slopes"]) == before


def test_a_memoized_tensor_helper_trains_and_its_cache_stays_real() -> None:
    """The capture filled the cache with a fake tensor of its trace: the capture failed on
    "Mixing fake modes", and the eager model, given the fake mask back, failed too."""
    _causal_mask.cache_clear()
    torch.manual_seed(0)
    wrapped = ORTModule(_MaskedAttention())
    eager = copy.deepcopy(wrapped.module)
    for length in (5, 5, 6):
        x = torch.randn(2, length, 8)
        loss = wrapped(x)  # first: the capture runs before eager PyTorch fills the cache
        loss.backward()
        expected = eager(x)
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    assert type(_causal_mask(5)) is torch.Tensor
    assert not wrapped._ortrain_fallback.active
