"""The view-scatter decompositions equal PyTorch's own kernels, offsets and negative dims included."""

from __future__ import annotations

import pytest
import torch

from ortrain.capture import decompositions_view_scatter as view_scatter

aten = torch.ops.aten


@pytest.mark.parametrize(("offset", "dim1", "dim2"), [(0, 0, 1), (1, 0, 2), (-2, -1, 1), (3, 1, 2)])
def test_diagonal_scatter_and_backward_match_pytorch(offset: int, dim1: int, dim2: int) -> None:
    torch.manual_seed(0)
    base = torch.randn(3, 5, 4)
    src = torch.randn_like(base.diagonal(offset, dim1, dim2))
    want = torch.diagonal_scatter(base, src, offset, dim1, dim2)
    torch.testing.assert_close(
        view_scatter.diagonal_scatter(base, src, offset, dim1, dim2), want, rtol=0, atol=0
    )
    want = aten.diagonal_backward(src, base.shape, offset, dim1, dim2)
    got = view_scatter.diagonal_backward(src, base.shape, offset, dim1, dim2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [((2, 3), (6, 1), 2), ((4,), (5,), None), ((3, 2), (1, 7), 1)],
)
def test_as_strided_scatter_matches_pytorch(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int | None
) -> None:
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    src = torch.randn(size)
    want = torch.as_strided_scatter(base, src, size, stride, offset)
    torch.testing.assert_close(
        view_scatter.as_strided_scatter(base, src, size, stride, offset), want, rtol=0, atol=0
    )


def test_as_strided_scatter_into_a_non_contiguous_base_is_left_to_pytorch() -> None:
    base = torch.randn(6, 4).t()
    assert view_scatter.as_strided_scatter(base, torch.randn(2), (2,), (1,), 0) is NotImplemented
