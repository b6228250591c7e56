"""A tensor times a number computed from a size the graph leaves open
(ortrain/capture/decompositions_math.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ortrain import ORTModule


class _VarianceTerms(nn.Module):
    """VICReg's variance and covariance terms over the batch, and an integer count scaled by it."""

    def __init__(self) -> None:
        super().__init__()
        self.projector = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.projector(x)
        centered = z - z.mean(0)
        covariance = centered.T @ centered / (z.shape[0] - 1)
        loss = torch.relu(1 - torch.sqrt(z.var(dim=0) + 1e-4)).mean() + covariance.pow(2).sum() / 6
        positives = (x > 0).long() * (x.shape[0] / 2)  # an integer tensor times a float: float
        return loss + z.std(0).mean() * (x.shape[0] / 2), positives


def test_var_and_std_over_a_dynamic_batch_train_on_ort() -> None:
    """Wave 30: their backward scales by ``2 / (n - 1)`` with ``n`` the open batch size, and the
    exporter's ``mul.Scalar`` took that for a Python float: with the default policy the whole
    backward ran in PyTorch, under FALLBACK_DISABLE (these tests' policy) the step failed."""
    torch.manual_seed(0)
    eager = _VarianceTerms()
    wrapped = ORTModule(copy.deepcopy(eager))
    for batch in (5, 7, 4):  # the second size captures with the batch size open
        x = torch.randn(batch, 8)
        (loss, positives), (expected, expected_positives) = wrapped(x), eager(x)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(positives, expected_positives)
        torch.testing.assert_close(wrapped.projector.weight.grad, eager.projector.weight.grad)
        wrapped.zero_grad()
        eager.zero_grad()
    assert len(wrapped._ortrain_graphs) == 2
