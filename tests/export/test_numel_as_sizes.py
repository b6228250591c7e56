"""A decomposition reading `numel()` of a tensor with an open size exports (export/numel_as_sizes.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ortrain import ORTModule


class _BinaryCrossEntropyInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy(torch.sigmoid(self.linear(x)), target)


def test_a_loss_whose_backward_reads_numel_trains_on_changing_batch_sizes(monkeypatch) -> None:
    """BCE's backward decomposition reads ``grad.numel()``: until wave 42 it (and sigmoid's backward
    with it) had no ONNX form once the batch size was open, and FALLBACK_DISABLE refused the model."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _BinaryCrossEntropyInside()
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (8, 6, 5):
        x, target = torch.randn(rows, 4), torch.rand(rows, 3)
        want, got = eager(x, target), wrapped(x, target)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want)
        for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)
