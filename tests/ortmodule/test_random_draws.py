"""Random operators beyond dropout draw eager's numbers: sampling from distributions inside a
forward (mixup's Beta, a Gamma's reparametrised sample, Dirichlet, Binomial) and ``random_``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _Sampling(nn.Module):
    """A draw in one chain and a dropout in another: the draws must also keep eager's order."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 6)

    def _draw(self) -> torch.Tensor:
        if self.kind == "beta":
            return torch.distributions.Beta(torch.full((8, 1), 0.4), torch.full((8, 1), 0.4)).sample()
        if self.kind == "gamma":
            return torch.distributions.Gamma(torch.full((8, 1), 2.0), torch.ones(8, 1)).rsample()
        if self.kind == "dirichlet":
            return torch.distributions.Dirichlet(torch.ones(8, 6)).sample()
        if self.kind == "binomial":
            return torch.distributions.Binomial(5, torch.full((8, 1), 0.3)).sample()
        return torch.empty(8, 1).random_(0, 4)  # "random_"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)) * self._draw()
        g = nn.functional.dropout(torch.tanh(self.second(x)), 0.3)
        return (h + g).square().mean()


@pytest.mark.parametrize("kind", ["beta", "gamma", "dirichlet", "binomial", "random_"])
def test_sampling_in_the_forward_draws_eagers_numbers(kind: str) -> None:
    """Gamma, Dirichlet and Binomial sampling had no ONNX translation and were not known as random:
    under FALLBACK_DISABLE the model was refused, elsewhere they ran in PyTorch with a warning and
    outside the ordering of draws. ``random_(low, high)`` is traced as ``aten.random.from``, which
    torch.fx writes into a region's code as ``torch.ops.aten.random.from(...)``: a SyntaxError."""
    torch.manual_seed(0)
    model = _Sampling(kind)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    for step in range(3):
        losses = []
        for module, optimizer in ((eager, eager_opt), (wrapped, opt)):
            torch.manual_seed(step)
            loss = module(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
    for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    # On ortrain's graphs (Beta's argument checks send it through graph breaks), not PyTorch's.
    assert not wrapped._ortrain_fallback.active
