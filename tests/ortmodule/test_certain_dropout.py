"""Dropout at p = 1 draws no mask, as eager's CPU kernel (ortrain/capture/certain_dropout.py): the
random numbers after it are eager's."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _ScheduledDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, p: float) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.a(x)), p, training=self.training)
        return self.b(h + torch.randn_like(h)).square().mean()


def test_dropout_at_p_one_leaves_the_generator_where_eager_does() -> None:
    """Wave 47's review: traced, p = 1 drew a mask (PyTorch's decomposition calls native_dropout),
    so the noise after it and every later draw came from another state than eager's."""
    torch.manual_seed(0)
    eager = _ScheduledDropout()
    wrapped = ORTModule(copy.deepcopy(eager))
    batches = [torch.randn(6, 8) for _ in range(4)]
    results = []
    for model in (eager, wrapped):
        torch.manual_seed(1)
        seen = []
        for p, x in zip((1.0, 1.0, 0.3, 1.0), batches, strict=True):
            loss = model(x, p)
            loss.backward()
            seen.append((loss.detach(), torch.rand(())))
        results.append(seen)
    for (expected, rand_e), (got, rand_o) in zip(*results, strict=True):
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(rand_o, rand_e)
    torch.testing.assert_close(wrapped.a.weight.grad, eager.a.weight.grad)
