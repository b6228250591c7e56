"""``as_strided`` of a tensor laid out otherwise than contiguously (a transposed input, a transposed
intermediate) reads PyTorch's memory: it runs in PyTorch, on its input in the traced layout."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _Windows(nn.Module):
    """Overlapping windows built from a tensor's own strides, as Longformer / LED chunk."""

    def __init__(self, of: str) -> None:
        super().__init__()
        self.of = of
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source = x if self.of == "input" else self.linear(x).transpose(0, 1).contiguous().transpose(0, 1)
        size = list(source.size())
        size[1] -= 1
        windows = source.as_strided(size=size, stride=list(source.stride()))
        return self.linear(windows).square().mean()


@pytest.mark.parametrize("of", ["input", "intermediate"])
@pytest.mark.parametrize("how", ["ORTModule", "torch.compile"])
def test_strided_views_of_transposed_tensors_match_eager(of: str, how: str, calls_like_eager) -> None:
    """torch.compile(backend="ortrain") gave losses off by 2e-2 for a transposed input, silently:
    ONNX Runtime's translation read its contiguous copy with the traced strides."""
    torch.manual_seed(0)
    eager = _Windows(of)
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model) if how == "ORTModule" else torch.compile(model, backend="ortrain")
    batches = [
        torch.randn(6 + 2 * step, 2, 4, generator=torch.Generator().manual_seed(step)).transpose(0, 1)
        for step in range(3)
    ]
    calls_like_eager(eager, wrapped, batches)
