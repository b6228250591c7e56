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


def _mask_with_default_cache(length: int, _cache: dict[int, torch.Tensor] = {}) -> torch.Tensor:  # noqa: B006
    if length not in _cache:
        _cache[length] = torch.triu(torch.ones(length, length), 1).bool()
    return _cache[length]


class _MaskStore:
    def __init__(self) -> None:
        self.masks: dict[int, torch.Tensor] = {}

    def get(self, length: int) -> torch.Tensor:
        if length not in self.masks:
            self.masks[length] = torch.triu(torch.ones(length, length), 1).bool()
        return self.masks[length]


_MASKS = _MaskStore()


class _CachedMasks(nn.Module):
    def __init__(self, shared_store: bool) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.shared_store = shared_store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        mask = _MASKS.get(length) if self.shared_store else _mask_with_default_cache(length)
        scores = (self.query(x) @ x.transpose(1, 2)).masked_fill(mask, float("-inf"))
        return scores.softmax(-1).pow(2).sum()


@pytest.mark.parametrize("shared_store", [False, True], ids=["default argument", "module-level object"])
def test_a_cache_kept_by_a_helper_holds_real_tensors(shared_store: bool) -> None:
    """A cache in a mutable default argument or in a module-level object's dict kept the capture's
    fake mask, and the next call in PyTorch failed on it (wave 30)."""
    _MASKS.masks.clear()
    _mask_with_default_cache.__defaults__[0].clear()  # type: ignore[index]
    torch.manual_seed(0)
    wrapped = ORTModule(_CachedMasks(shared_store))
    eager = copy.deepcopy(wrapped.module)
    for length in (5, 5, 6):
        x = torch.randn(2, length, 8)
        assert wrapped(x).item() == pytest.approx(eager(x).item(), rel=1e-5)
    cache = _MASKS.masks if shared_store else _mask_with_default_cache.__defaults__[0]  # type: ignore[index]
    assert {type(mask) for mask in cache.values()} == {torch.Tensor}
