"""Integer sums in ONNX Runtime equal eager's bit for bit: past 2**53 and wrapped past the type's
range (wave 53's review: ONNX Runtime's ReduceSum added int64 in double and saturated, so
``x.sum(-1)`` of ``[2**62 - 1, 2**62 - 1, 12345]`` was int64's maximum and a rolling n-gram hash
put every n-gram in another bucket)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ortrain import ORTModule

BIG = 2**62 - 1

SUMS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "whole and along dimensions": lambda x: (
        x.sum(),
        x.sum(-1),
        x.sum((0, -1), keepdim=True),
        torch.sum(x, 0),
        torch.einsum("ij->i", x),
    ),
    "into int32": lambda x: (
        x.sum(-1, dtype=torch.int32),
        (x % 2**31).int().sum(dtype=torch.int32),
        (x % 2**31).int().sum(0),  # int32 values into int64: past 2**31, wrapping nothing
    ),
    "booleans and bytes": lambda x: ((x > 0).sum(-1), (x % 251).to(torch.uint8).sum()),
}


class _Summed(nn.Module):
    def __init__(self, sums: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.sums = sums

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.w * x.float().sum()).sum(), *self.sums(x)


@pytest.mark.parametrize("case", list(SUMS), ids=str)
def test_integer_sums_match_eager_bit_for_bit(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # ONNX Runtime runs them
    eager = _Summed(SUMS[case])
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (3, 1, 0):
        # rows that pass 2**53 by one, that wrap past 2**63, and small ones
        x = torch.tensor([[2**53], [BIG], [-BIG], [7]]) + torch.arange(length)
        for expected, got in zip(eager(x)[1:], wrapped(x)[1:], strict=True):
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got, expected), (length, got, expected)


class _HashedNgrams(nn.Module):
    """Byte n-grams hashed into buckets by a rolling polynomial hash (Meta's BLT)."""

    def __init__(self, n: int = 3, buckets: int = 97) -> None:
        super().__init__()
        self.n, self.buckets = n, buckets
        self.embedding = nn.Embedding(buckets, 8)
        self.head = nn.Linear(8, 256)

    def forward(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = data.unfold(1, self.n, 1)
        powers = torch.tensor(1_000_000_007) ** torch.arange(self.n)  # wraps past 2**63
        buckets = torch.sum(windows * powers, dim=-1) % self.buckets
        logits = self.head(self.embedding(buckets))
        targets = data[:, self.n - 1 :]
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()), buckets


def test_a_rolling_hash_trains_as_in_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _HashedNgrams()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step in range(2):
        data = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(step))
        (loss, buckets), (got_loss, got_buckets) = eager(data), wrapped(data)
        assert torch.equal(got_buckets, buckets)
        torch.testing.assert_close(got_loss, loss)
        loss.backward()
        got_loss.backward()
        torch.testing.assert_close(wrapped.module.embedding.weight.grad, eager.embedding.weight.grad)
