"""An interpolation by a scale that keeps the input's size copies, as eager's kernels do
(ortrain/capture/same_size_interpolation.py); other scales interpolate as before."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _Rescaled(nn.Module):
    def __init__(self, shape: tuple[int, ...], mode: str, scale: float) -> None:
        super().__init__()
        self.mode, self.scale = mode, scale
        self.w = nn.Parameter(torch.randn(*shape, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.interpolate(self.w, scale_factor=self.scale, mode=self.mode) * x).sum()


@pytest.mark.parametrize(
    ("mode", "shape"),
    [
        ("nearest", (1, 2, 6, 6)),
        ("bilinear", (1, 2, 6, 6)),
        ("linear", (1, 2, 6)),
        ("trilinear", (1, 2, 4, 4, 4)),
    ],
)
@pytest.mark.parametrize("scale", [1.1, 2.0])
def test_an_interpolation_to_the_same_size_is_eagers_copy(
    mode: str, shape: tuple[int, ...], scale: float
) -> None:
    """Wave 47's review: at scale 1.1 on a 6 x 6 map (the same size out) the traced decomposition
    interpolated by 1/1.1 where eager copies: a loss of -12.9 for eager's -4.2, silently."""
    torch.manual_seed(0)
    eager = _Rescaled(shape, mode, scale)
    wrapped = ORTModule(copy.deepcopy(eager))
    out_shape = eager.w.shape[:2] + tuple(int(n * scale) for n in shape[2:])
    x = torch.randn(out_shape, dtype=torch.float64)
    expected, got = eager(x), wrapped(x)
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    torch.testing.assert_close(wrapped.w.grad, eager.w.grad)
