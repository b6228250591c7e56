"""A detached view of another output stays detached: no gradient flows through it, at every size
(wave 45's review: from the first capture with open sizes on, ``h[:, 0:1].detach()`` came back
requiring grad through ``h``, 26 where eager's largest gradient was 5)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _WeightedByItsOwnColumn(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.form = form

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.linear(x)
        target = h[:, 0:1].detach() if self.form == "slice" else h.t().detach()
        return h, target


@pytest.mark.parametrize("form", ["slice", "transpose"])
def test_a_detached_view_of_an_output_gets_no_gradient_at_new_sizes(form: str) -> None:
    torch.manual_seed(0)
    eager = _WeightedByItsOwnColumn(form)
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (6, 9, 4):  # the second size captures with the batch left open
        x = torch.randn(rows, 8)
        for model in (eager, wrapped):
            h, target = model(x)
            assert not target.requires_grad, f"{rows} rows"
            weights = target if form == "slice" else target.t()
            ((h - 1.0) * weights[:, :1]).sum().backward()
        torch.testing.assert_close(wrapped.linear.weight.grad, eager.linear.weight.grad)
        eager.zero_grad()
        wrapped.zero_grad()


class _CountsWeightedByADetachedColumn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return (torch.bincount(labels, weights=h[:, 0].detach()) * h[:1, 0] + h.sum()).sum()


def test_a_detached_view_feeding_a_graph_break_trains_at_new_sizes() -> None:
    """The same view between TorchDynamo's graphs (``bincount`` breaks the graph): its backward
    failed from the second size on, "derivative for aten::bincount is not implemented"."""
    torch.manual_seed(0)
    eager = _CountsWeightedByADetachedColumn()
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows, classes in ((6, 3), (9, 5), (4, 2)):
        x, labels = torch.randn(rows, 8), torch.randint(0, classes, (rows,))
        eager(x, labels).backward()
        wrapped(x, labels).backward()
        torch.testing.assert_close(wrapped.linear.weight.grad, eager.linear.weight.grad)
        eager.zero_grad()
        wrapped.zero_grad()


class _ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.linear(x), x[:, :3], x.detach().view(-1)


def test_a_view_of_the_input_next_to_a_detached_one_keeps_its_gradient() -> None:
    """``x[:, :3]`` was made again as a view of ``x.detach().view(-1)`` (the other output over the
    same memory): it lost its history, and ``x``'s gradient through it, at every size."""
    torch.manual_seed(0)
    eager = _ReturnsItsInput()
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (4, 6):
        x = torch.randn(rows, 8)
        grads = []
        for model in (eager, wrapped):
            given = x.clone().requires_grad_()
            h, view, detached = model(given)
            assert (view.requires_grad, detached.requires_grad) == (True, False)
            ((view * h[:, :3]).sum() + detached.sum()).backward()
            grads.append(given.grad)
        torch.testing.assert_close(grads[1], grads[0])
