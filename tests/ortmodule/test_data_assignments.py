"""``tensor.data = value`` inside the forward: captured as eager runs it, or refused with what to do."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from _parity import assert_same_state
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.errors import ORTModuleTorchModelException


class _MomentumEncoder(nn.Module):
    """MoCo's key encoder, moved towards the query encoder at every forward by ``.data =``."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.key = nn.Linear(8, 8)
        self.key.requires_grad_(False)
        self.register_buffer("center", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.query(x)
        with torch.no_grad():
            for pq, pk in zip(self.query.parameters(), self.key.parameters(), strict=True):
                pk.data = pk.data * 0.9 + pq.data * 0.1
            self.center.data = self.center * 0.9 + q.mean(0) * 0.1  # DINO's teacher centering
        return (q - self.key(x) - self.center).square().mean()


def _train(model: nn.Module, steps: int = 4) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _trains_like_eager_in_one_graph(model_class: type[nn.Module]) -> None:
    """Four steps with eager's losses and state, from one captured graph (no fallback)."""
    torch.manual_seed(0)
    eager = model_class()
    wrapped = ORTModule(copy.deepcopy(eager))
    losses, expected = _train(wrapped), _train(eager)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-6)
    assert not wrapped._ortrain_fallback.active and len(wrapped._ortrain_graphs) == 1


def test_data_assigned_in_forward_reaches_the_model_as_in_eager() -> None:
    """Wave 23: the trace lost the assignment; the key encoder never moved and the first loss
    was already off (0.47 against eager's 0.38), without a word."""
    _trains_like_eager_in_one_graph(_MomentumEncoder)
    assert "data" not in torch.Tensor.__dict__  # the setter is ortrain's only during a capture


class _Router(nn.Module):
    """Switch Transformers' router moves its classifier to its dtype in every forward: ``.to()``
    of a module whose parameters already have it sets ``p.data = p``, which changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(torch.float32).to(x.device)
        with torch.no_grad():
            self.classifier.bias.data = self.classifier.bias.detach()
        return F.softmax(self.classifier(x), dim=-1).square().mean()


@pytest.mark.filterwarnings("error::UserWarning")
def test_assigning_a_tensor_its_own_memory_is_captured_as_nothing() -> None:
    """It was refused as a value sharing a parameter's storage: the model trained in PyTorch.
    (``module.to()`` also reads each ``p.grad``, which warned about a non-leaf's ``.grad`` while
    traced.)"""
    _trains_like_eager_in_one_graph(_Router)


class _Assigns(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            if self.how == "alias":
                self.b.weight.data = self.a.weight.data  # ties the two in eager PyTorch
            elif self.how == "input":
                self.b.bias.data = x[0]
            elif self.how == "written after":
                value = self.b.weight * 0.5
                self.b.weight.data = value
                value.add_(1.0)
            elif self.how == "intermediate":
                h.data = h.data * 2
        return self.b(h).sum()


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("alias", "shares its storage with a parameter, buffer or input"),
        ("input", "shares its storage with a parameter, buffer or input"),
        ("written after", "writes into the value after assigning it"),
        ("intermediate", "is not a parameter or buffer of the model"),
    ],
)
def test_assignments_a_copy_cannot_express_are_refused(how: str, why: str) -> None:
    wrapped = ORTModule(_Assigns(how))
    with pytest.raises(ORTModuleTorchModelException, match=f"assigns `tensor.data = value` where .*{why}"):
        wrapped(torch.randn(2, 4))
    assert "data" not in torch.Tensor.__dict__


def test_refused_assignment_falls_back_and_trains_like_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the default policy: PyTorch takes over
    torch.manual_seed(0)
    eager = _Assigns("alias")
    wrapped = ORTModule(copy.deepcopy(eager))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for module in (eager, wrapped):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
            module(x).backward()
    assert wrapped._ortrain_fallback.active
    assert "p.mul_(m).add_(q.detach(), alpha=1 - m)" in caplog.text
    assert wrapped.b.weight.data_ptr() == wrapped.a.weight.data_ptr()  # tied, as in eager
    assert_same_state(wrapped, eager, atol=0)


class _QueuedMomentumEncoder(_MomentumEncoder):
    """MoCo whole: its queue pointer is read as a Python int, so the model splits at a graph break
    and TorchDynamo traces ``.data =`` (as a ``set_`` AOTAutograd cannot keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("queue", torch.zeros(8, 8))
        self.register_buffer("pointer", torch.zeros(1, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = super().forward(x)
        start = int(self.pointer)
        with torch.no_grad():
            self.queue[start : start + x.shape[0]] = F.normalize(self.key(x), dim=1)
            self.pointer[0] = (start + x.shape[0]) % self.queue.shape[0]
        return loss + (self.query(x) @ self.queue.T).mean()


def test_data_assignment_under_graph_breaks_falls_back_saying_what_to_write(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the default policy: PyTorch takes over
    torch.manual_seed(0)
    eager = _QueuedMomentumEncoder()
    wrapped = ORTModule(copy.deepcopy(eager))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        losses = _train(wrapped, steps=3)
    expected = _train(eager, steps=3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-6)
    assert wrapped._ortrain_fallback.active
    assert "the forward assigns `tensor.data = value`: a captured graph cannot replace" in caplog.text
