"""TorchScript inside a model (a ``torch.jit.script`` function, a scripted submodule) is captured
with its gradients, also after it has run eagerly (ortrain/capture/tracing_context.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


@torch.jit.script
def _erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class _WithTorchScript(nn.Module):
    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part
        self.first = nn.Linear(8, 16)
        if part == "module":
            self.inner = torch.jit.script(_Residual())
        elif part == "traced":  # its tables are its script module's (wave 47: a KeyError in the guards)
            self.inner = torch.jit.trace(_Residual(), torch.randn(2, 16))
        else:
            self.inner = _Residual()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.part == "function":
            h = _erf_gelu(h)
        return F.cross_entropy(self.head(self.inner(h)), y)


def _build(part: str) -> nn.Module:
    torch.manual_seed(0)
    return _WithTorchScript(part)  # built twice: a deep copy of a scripted module has non-leaf weights


@pytest.mark.parametrize("part", ["function", "module", "traced"])
def test_torchscript_that_ran_eagerly_keeps_the_gradients_below_it(part: str) -> None:
    """TorchScript's optimizing executor, once it had profiled a few eager calls, ran the part as
    one opaque autograd node while the capture traced it: the graph had no gradient for the layers
    below it, so they got None and never trained (wave 29: the loss 0.1 off after four steps)."""
    eager, wrapped = _build(part), ORTModule(_build(part))
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for _ in range(3):  # as ortrain's op tuning does by default: the first calls run eagerly
        eager(x, y)
        wrapped.module(x, y)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    for _ in range(3):
        losses = []
        for module in (eager, wrapped):
            loss = module(x, y)
            loss.backward()
            losses.append(loss)
        for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(losses[1], losses[0])
    assert len(wrapped._ortrain_graphs) == 1 and wrapped._ortrain_graph_breaks is None
