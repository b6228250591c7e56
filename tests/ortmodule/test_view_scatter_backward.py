"""Views that pick scattered elements train on ONNX Runtime: their backward is a view-scatter.

``x.diagonal()``, ``torch.diag``, an in-place op on a diagonal, ``diagonal_scatter`` and
``as_strided_scatter`` all lead to ops (``diagonal_backward``, ``diagonal_scatter``,
``as_strided_scatter``) that PyTorch decomposes into a write through a view (``prims.copy_to``),
which the export refused. With FALLBACK_DISABLE (conftest) a pass means ONNX Runtime ran both
graphs whole.
"""

from __future__ import annotations

import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn


class ViewScatters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)  # [B, 6, 6]
        loss = y.diagonal(offset=1, dim1=0, dim2=2).pow(2).sum()
        loss = loss + torch.diag(y[0]).sum() + torch.diag(y[1, 0]).pow(2).sum()
        loss = loss + torch.diagonal_scatter(y, y[:, 0, :].cos(), 0, 1, 2).pow(2).mean()
        loss = loss + torch.as_strided_scatter(y, y[0, :2, :3].sin(), (2, 3), (6, 1), 2).pow(2).mean()
        z = y.clone()
        z.diagonal(dim1=1, dim2=2).mul_(3)  # functionalized into a diagonal_scatter
        return loss + z.pow(2).mean()


def test_diagonal_and_strided_view_scatters_train_like_eager() -> None:
    torch.manual_seed(0)
    # The third batch has another size: the dynamic capture scatters at positions built at run time.
    batches = [torch.randn(3, 6, 6), torch.randn(3, 6, 6), torch.randn(5, 6, 6)]
    losses, expected, eager, wrapped = train_side_by_side(ViewScatters(), batches, lambda m, x: m(x), lr=0.01)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert ort_graph_count(wrapped) == 2


class ShiftedWindowAttention(nn.Module):
    """Swin-style: rolled windows, attention inside each, rolled back, written into slices in place."""

    def __init__(self, dim: int = 8, window: int = 2, shift: int = 1) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.window, self.shift = window, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, W, C]
        b, h, w, c = x.shape
        s, n = self.shift, self.window
        x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        windows = x.view(b, h // n, n, w // n, n, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, n * n, c)
        q, k, v = self.qkv(windows).chunk(3, -1)
        attended = (q @ k.transpose(-1, -2) / c**0.5).softmax(-1) @ v
        y = self.proj(attended).view(b, h // n, w // n, n, n, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        y = torch.roll(y, shifts=(s, s), dims=(1, 2))
        out = x.clone()
        out[:, :, : w // 2] = y[:, :, : w // 2] * 2
        out[:, 1::2, w // 2 :] += y[:, 1::2, w // 2 :]
        out.diagonal(dim1=1, dim2=2).mul_(0.5)
        return out


def test_shifted_window_attention_with_in_place_slices_trains_like_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ShiftedWindowAttention(), ShiftedWindowAttention(shift=0))
    batches = [torch.randn(2, 4, 4, 8) for _ in range(2)]
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x).pow(2).mean())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert ort_graph_count(wrapped) == 1


class BroadcastCopies(nn.Module):
    """Slots of a buffer filled from smaller tensors: a grid's coordinates, a parameter per row."""

    def __init__(self) -> None:
        super().__init__()
        self.vec = nn.Parameter(torch.randn(5))
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 5, 3]
        base = torch.empty(x.shape[0], 5, 3)
        base.select(-1, 0).copy_(torch.linspace(-1, 1, 5))  # [5] into a [B, 5] slot
        base.select(-1, 1).copy_(self.vec)
        base.select(-1, 2).fill_(1)
        return self.linear(x + base).square().mean()


def test_a_copy_that_broadcasts_into_a_view_trains_like_eager() -> None:
    """onnxscript translates ``copy`` as a cast of the source alone: the broadcast was lost and
    ONNX Runtime failed on the scatter that writes the slot back ("Indices and updates must have
    the same rank"), as in ``affine_grid``'s backward."""
    torch.manual_seed(0)
    batches = [torch.randn(2, 5, 3) for _ in range(3)]
    losses, expected, eager, wrapped = train_side_by_side(BroadcastCopies(), batches, lambda m, x: m(x))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert ort_graph_count(wrapped) == 1
