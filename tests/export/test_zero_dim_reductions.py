"""Reductions of a 0-d tensor over its dimension 0 or -1 run in ONNX Runtime as in PyTorch: the
element itself (index 0), NaN included, with keepdim too (wave 52: ONNX Runtime refused to load
them, "axis must be in [-rank, rank-1]. Input rank was 0")."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ortrain import ORTModule

REDUCTIONS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "max/min with a dimension": lambda w: (*torch.max(w, 0), *torch.min(w, -1, keepdim=True)),
    "argmax/argmin": lambda w: (w * 2, torch.argmax(w, 0), torch.argmin(w, -1, keepdim=True)),
    "amax/amin": lambda w: (torch.amax(w, 0), torch.amin(w, -1, keepdim=True)),
    "infinity norms": lambda w: (
        torch.linalg.vector_norm(w, math.inf, 0),
        torch.linalg.vector_norm(w, -math.inf, -1, keepdim=True),
    ),
    "norms, prod, var": lambda w: (
        torch.linalg.vector_norm(w, 2, 0),
        torch.linalg.vector_norm(w, 3, -1),
        w.prod(0),
        w.var(0, correction=0),
        torch.std_mean(w, -1, correction=0)[1],
    ),
    "all/any": lambda w: (w * w.gt(0).all(0), w * w.lt(0).any(-1, keepdim=True)),
}


class _Reduced(nn.Module):
    def __init__(self, reduce: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], value: float) -> None:
        super().__init__()
        self.reduce = reduce
        self.w = nn.Parameter(torch.tensor(value))

    def forward(self) -> tuple[torch.Tensor, ...]:
        return self.reduce(self.w)


@pytest.mark.parametrize("value", [1.5, math.nan], ids=["finite", "nan"])
@pytest.mark.parametrize("reduction", list(REDUCTIONS), ids=str)
def test_zero_dim_reductions_over_a_dimension_match_eager(
    reduction: str, value: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # ONNX Runtime runs them
    eager = _Reduced(REDUCTIONS[reduction], value)
    wrapped = ORTModule(copy.deepcopy(eager))
    expected, got = eager(), wrapped()
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, equal_nan=True)
    sum(e.float().sum() for e in expected if e.is_floating_point()).backward()
    sum(g.float().sum() for g in got if g.is_floating_point()).backward()
    torch.testing.assert_close(wrapped.module.w.grad, eager.w.grad, equal_nan=True)
