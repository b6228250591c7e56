"""Views that pick scattered elements train on ONNX Runtime: their backward is a view-scatter.

``x.diagonal()``, ``torch.diag``, an in-place op on a diagonal, ``diagonal_scatter`` and
``as_strided_scatter`` all lead to ops (``diagonal_backward``, ``diagonal_scatter``,
``as_strided_scatter``) that PyTorch decomposes into a write through a view (``prims.copy_to``),
which the export refused. With FALLBACK_DISABLE (conftest) a pass means ONNX Runtime ran both
graphs whole.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.ortmodule._parity import assert_same_state, ort_graph_count, train_side_by_side


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
