"""Tensors a forward reads from outside the model's parameters, buffers and tensor attributes.

AOTAutograd lifts only the module's own state to graph inputs; a real tensor reached another way
failed the capture ("Please convert all Tensors to FakeTensors first"), and the model trained in
PyTorch (an error under FALLBACK_DISABLE). Such a model now trains through TorchDynamo's graph
breaks, which pass those tensors to the graphs at every step: changes to them, in place or by
rebinding, are what the next step reads.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule

pytestmark = pytest.mark.usefixtures("shared_export_cache")

OFFSET = torch.zeros(4)  # a module-level tensor the script changes


class _Distilled(nn.Module):
    """A student with its teacher kept in a list, so that ``parameters()`` leaves it out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self._teacher = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))]
        self.anchors = [torch.ones(4), torch.full((4,), 0.5)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        student = self.b(torch.relu(self.a(x))) * self.anchors[0] + self.anchors[1] + OFFSET
        with torch.no_grad():
            teacher = self._teacher[0](x)
        return F.kl_div(student.log_softmax(-1), teacher.softmax(-1), reduction="batchmean")


def _change_outside_state(model: nn.Module, step: int) -> None:
    with torch.no_grad():
        for p in model._teacher[0].parameters():  # an EMA-style teacher update, in place
            p.mul_(0.9)
        model.anchors[0].add_(0.1)
    if step == 2:
        model.anchors[1] = torch.full((4,), -0.5)  # an entry replaced


def test_a_teacher_in_a_list_and_outside_tensors_train_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    eager = _Distilled()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    for step in range(4):
        monkeypatch.setattr(f"{__name__}.OFFSET", torch.full((4,), 0.1 * step))  # rebound
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        for m, inner, optimizer in ((eager, eager, optimizers[0]), (wrapped, model, optimizers[1])):
            if step:
                _change_outside_state(inner, step)
            loss = m(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if m is eager:
                expected = loss.item()
        assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7), f"step {step}"
    for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert wrapped._ortrain_graph_breaks is not None  # TorchDynamo's graphs, not PyTorch
