"""``nn.EmbeddingBag`` trains on ONNX Runtime as in eager, in each mode and at a new number of bags
(its decomposition: ortrain/capture/decompositions_embedding.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _Bags(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 6, mode=mode, padding_idx=3)
        self.head = nn.Linear(6, 2)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(indices, offsets)).pow(2).mean()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bags_train_like_eager_at_new_sizes(mode: str) -> None:
    torch.manual_seed(0)
    eager = _Bags(mode).double()
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, wrapped)]
    for bags in (4, 7, 5):  # the second count captures with the sizes left open
        per_bag = torch.randint(0, 4, (bags,))  # empty bags too
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), per_bag.cumsum(0)[:-1]])
        indices = torch.randint(0, 30, (int(per_bag.sum()),))
        for model, optimizer in zip((eager, wrapped), optimizers, strict=True):
            optimizer.zero_grad()
            model(indices, offsets).backward()
        torch.testing.assert_close(wrapped.bag.weight.grad, eager.bag.weight.grad, msg=f"{bags} bags")
        for optimizer in optimizers:
            optimizer.step()


class _MaxBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(8, 3, mode="max")

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(indices, offsets)


def test_a_nan_in_a_max_bag_counts_where_eager_counts_it() -> None:
    # Wave 49's regression reviews: the scatter-based max skipped a NaN, and a bag whose maximum
    # no row then equalled sent its gradient to index -1 (ONNX Runtime: out of bounds); then any
    # NaN won. PyTorch's kernel keeps a running maximum: a NaN counts as a bag's first row only.
    torch.manual_seed(0)
    eager = _MaxBag().double()
    with torch.no_grad():
        eager.bag.weight[5, 1] = torch.nan
    wrapped = ORTModule(copy.deepcopy(eager))
    indices, offsets = torch.tensor([1, 5, 5, 2, 3, 5, 4]), torch.tensor([0, 2, 4])
    expected, got = eager(indices, offsets), wrapped(indices, offsets)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert got[1, 1].isnan() and not got[0, 1].isnan() and not got[2, 1].isnan()
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(wrapped.bag.weight.grad, eager.bag.weight.grad)


@pytest.mark.parametrize(
    ("offsets", "mode", "message"),
    [
        ([0, 4, 2], "sum", "Expected i < index_size"),  # decreasing
        ([0, 2, 9], "max", "offsets\\[-1\\] can not be greater than input's length"),
        ([1, 2, 6], "mean", "offsets\\[0\\] has to be 0"),
    ],
)
def test_offsets_pytorch_refuses_raise_pytorchs_error(offsets: list[int], mode: str, message: str) -> None:
    """The bags came out of any offsets (``[0, 4, 2]`` pooled as ``[0, 2, 4]``), where eager raises
    (wave 51's review); a good batch after the refused one trains as before."""
    torch.manual_seed(0)
    wrapped = ORTModule(nn.EmbeddingBag(30, 6, mode=mode))
    indices = torch.randint(0, 30, (6,))
    for good in ([0, 2, 3], [0, 1, 5]):  # the second captures with the sizes left open
        wrapped(indices, torch.tensor(good)).sum().backward()
    with pytest.raises(RuntimeError, match=message):
        wrapped(indices, torch.tensor(offsets))
    expected = nn.functional.embedding_bag(indices, wrapped.module.weight, torch.tensor([0, 3, 4]), mode=mode)
    torch.testing.assert_close(wrapped(indices, torch.tensor([0, 3, 4])), expected)
