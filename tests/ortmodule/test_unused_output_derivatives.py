"""An output returned beside the loss for logging, whose derivative is infinite somewhere.

Training calls ``loss.backward()`` alone: eager never runs that output's backward. Fed a zero
gradient through it, 0 * inf = NaN reached every parameter upstream (wave 53's review: a
classifier logging ``log(sigmoid(logits))`` of a confident negative). Each path runs the backward
without that gradient: one ONNX Runtime session, regions around PyTorch work, graph breaks.
"""

from __future__ import annotations

import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn
from torch.nn import functional as F


class LoggedProbabilities(nn.Module):
    """A classifier returning its loss and the log-probability (or logit) of each sample."""

    def __init__(self, logged: str, path: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.logged = logged
        self.path = path
        with torch.no_grad():  # a confident negative: the sigmoid underflows to 0
            self.body[2].bias.fill_(-200.0)
            self.body[2].weight.mul_(30.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body[1](self.body[0](x))
        if self.path == "torch region":  # a determinant: PyTorch runs it, between two sessions
            h = h + 1e-3 * torch.linalg.det(h.reshape(-1, 2, 2)).reshape(h.shape[0], -1).sum(-1, keepdim=True)
        if self.path == "graph break" and h.sum().item() > -1e9:
            h = h * 1.0
        logits = self.body[2](h).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        p = torch.sigmoid(logits)
        return loss, torch.log(p) if self.logged == "log" else torch.logit(p)


@pytest.mark.parametrize(
    ("logged", "path"),
    [("log", "one session"), ("logit", "torch region"), ("log", "graph break")],
)
def test_an_unused_output_with_an_infinite_derivative_leaves_the_gradients_alone(
    logged: str, path: str
) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    logged_values: list[torch.Tensor] = []

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss, logged_value = module(*batch)
        logged_values.append(logged_value.detach())
        return loss

    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        LoggedProbabilities(logged, path), [(x, y)] * 2, loss_fn
    )
    assert torch.isinf(logged_values[0]).any()  # the logged value is -inf where the derivative is infinite
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)
