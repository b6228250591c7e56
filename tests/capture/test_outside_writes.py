"""A forward that writes in place into a real tensor outside the model (a momentum encoder kept in
a plain list, a module-level counter) makes the write once per call, as eager: each capture
attempt had made it too (wave 49's review: BYOL's target moved three times on the first step)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.capture.outside_writes import note_write, outside_writes_undone


class _MomentumPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Linear(3, 2)
        self.target = [copy.deepcopy(self.online)]  # kept out of parameters() and the optimizer
        self.calls = [torch.zeros(())]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls[0].add_(1)
            for t, o in zip(self.target[0].parameters(), self.online.parameters(), strict=True):
                t.mul_(0.5).add_(o, alpha=0.5)
        return (self.online(x) - self.target[0](x)).pow(2).mean() + self.online(x).sum()


def test_outside_tensors_are_written_once_per_call() -> None:
    torch.manual_seed(0)
    eager = _MomentumPair()
    with torch.no_grad():
        eager.target[0].weight.mul_(2)  # apart from the online weights, so that the update shows
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    x = torch.randn(4, 3)
    for step in range(3):
        for module in (eager, wrapped):
            module(x).backward()
        torch.testing.assert_close(model.calls[0], eager.calls[0], msg=f"step {step}")
        torch.testing.assert_close(model.target[0].weight, eager.target[0].weight, msg=f"step {step}")
        torch.testing.assert_close(model.online.weight.grad, eager.online.weight.grad, msg=f"step {step}")


def test_only_writes_into_real_tensors_are_undone() -> None:
    kept, written = torch.ones(2), torch.ones(2)
    with outside_writes_undone():
        note_write(torch.Tensor.mul_, (written, 3.0), {})
        written.mul_(3.0)
        note_write(torch.Tensor.mul, (kept, 3.0), {})  # not in place: nothing to keep
    assert torch.equal(written, torch.ones(2)) and torch.equal(kept, torch.ones(2))


def test_a_tensor_resized_by_the_write_gets_its_size_back() -> None:
    sized = torch.empty(0)
    with outside_writes_undone():
        note_write(torch.Tensor.resize_, (sized, 3), {})
        sized.resize_(3).fill_(1.0)
    assert sized.shape == (0,)


class _InputGradients(nn.Module):
    """A PINN's per-point input derivatives, built with torch.func inside the forward."""

    def __init__(self, transform: str) -> None:
        super().__init__()
        self.transform = transform
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def u(point: torch.Tensor) -> torch.Tensor:
            return self.net(point).squeeze(-1)

        if self.transform == "grad":
            return torch.func.vmap(torch.func.grad(u))(x).pow(2).mean()
        if self.transform == "hessian":
            return torch.func.vmap(torch.func.hessian(u))(x).sum((-1, -2)).pow(2).mean()
        return torch.func.vmap(lambda p: u(p).clone().mul_(2.0))(x).pow(2).mean()  # in place


@pytest.mark.parametrize("transform", ["grad", "hessian", "in_place_under_vmap"])
def test_writes_inside_a_torch_func_transform_are_not_outside_writes(
    monkeypatch: pytest.MonkeyPatch, calls_like_eager: Any, transform: str
) -> None:
    # The transforms' wrapper tensors are plain Tensors by type: counted as outside tensors, their
    # write-back after the transform had ended failed every capture (wave 51's review).
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _InputGradients(transform).double()
    batches = [torch.rand(rows, 2, dtype=torch.float64) for rows in (16, 24)]
    calls_like_eager(eager, ORTModule(copy.deepcopy(eager)), batches)
