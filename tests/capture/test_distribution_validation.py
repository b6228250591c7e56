"""``torch.distributions``' argument checks: off while ortrain traces, as the user had them after."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributions import Distribution, Normal

from ortrain import ORTModule


class _GaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Linear(6, 3)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.mean(x)
        self.kept.append(mean.detach())  # a list kept across calls: the graph-break path
        return -Normal(mean, torch.ones(3)).log_prob(torch.zeros(3)).mean()


def test_checks_are_off_while_tracing_and_the_users_afterwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile turns them off for the process; ortrain's graph-break path builds with it, and
    after its first step a user's eager ``Normal(0, -1)`` gave NaN instead of eager's ValueError
    (wave 45's review). With them on, the whole-graph capture failed on their data-dependent
    checks."""
    monkeypatch.setattr(Distribution, "_validate_args", True)
    torch.manual_seed(0)
    eager = _GaussianPolicy()
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (4, 5):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(wrapped(x), eager(x))
    assert Distribution._validate_args is True
    with pytest.raises(ValueError, match="scale"):
        Normal(torch.zeros(2), -torch.ones(2))
