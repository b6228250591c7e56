"""ortrain's own decompositions against PyTorch's native kernels."""

from __future__ import annotations

import itertools

import pytest
import torch

from ortrain.capture.decompositions import adaptive_avg_pool2d_backward, convolution_backward

aten = torch.ops.aten

CONV_CASES = [
    # (spatial dims, in channels, out channels, kernel, stride, padding, dilation, groups, size)
    (2, 4, 6, 3, 1, 1, 1, 1, 9),
    (2, 4, 6, 3, 2, 0, 1, 2, 10),
    (2, 6, 6, 3, 2, 2, 2, 6, 11),  # depthwise, dilated, stride leaving a remainder
    (2, 3, 4, 1, 1, 0, 1, 1, 5),
    (2, 4, 8, 5, 3, 1, 1, 4, 13),
    (1, 4, 6, 3, 2, 1, 1, 2, 12),
    (3, 2, 4, 3, 2, 1, 1, 1, 7),
]


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_convolution_backward_matches_native(case: tuple, mask: tuple[bool, bool, bool]) -> None:
    dims, c_in, c_out, k, stride, padding, dilation, groups, size = case
    torch.manual_seed(0)
    x = torch.randn(3, c_in, *([size] * dims), dtype=torch.float64)
    w = torch.randn(c_out, c_in // groups, *([k] * dims), dtype=torch.float64)
    args = ([stride] * dims, [padding] * dims, [dilation] * dims)
    y = aten.convolution(x, w, None, *args, False, [0] * dims, groups)
    g = torch.randn_like(y)
    want = aten.convolution_backward(g, x, w, [c_out], *args, False, [0] * dims, groups, list(mask))
    got = convolution_backward(g, x, w, [c_out], *args, False, [0] * dims, groups, mask)
    for a, b, needed in zip(got, want, mask, strict=True):
        if needed:
            torch.testing.assert_close(a, b)
        else:
            assert a is None


def test_transposed_convolution_is_left_to_pytorch() -> None:
    x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 3, 3)
    result = convolution_backward(x, x, w, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1, [True] * 3)
    assert result is NotImplemented


@pytest.mark.parametrize(
    ("size", "out"), list(itertools.product([(8, 8), (7, 10)], [(1, 1), (2, 4), (3, 3)]))
)
def test_adaptive_avg_pool2d_backward_matches_native(size: tuple[int, int], out: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    g = torch.randn(2, 3, *out, dtype=torch.float64)
    torch.testing.assert_close(adaptive_avg_pool2d_backward(g, x), aten._adaptive_avg_pool2d_backward(g, x))
