"""A returned view of an intermediate the backward saves, written in place by the caller, leaves
the gradients as they were at every batch size (ortrain/capture/saved_output_copies.py); a
returned saved tensor itself, written in place, is refused as eager refuses it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _TanhHead(nn.Module):
    def __init__(self, returned: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.returned = returned

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x))  # tanh's backward reads h
        shown = {"slice": h[:, :2], "transposed": h.t(), "flat": h.view(-1), "itself": h}[self.returned]
        return (h * 2).sum(), shown


@pytest.mark.parametrize("returned", ["slice", "transposed", "flat"])
def test_a_write_into_a_returned_view_of_a_saved_tensor_changes_no_gradient(returned: str) -> None:
    """Wave 47's review: from the second (open-size) capture on, the view shared the saved tensor's
    memory but not its version counter, and the backward read the written values (a bias gradient
    of -19.4 where the unwritten one is 4.95)."""
    torch.manual_seed(0)
    reference = _TanhHead(returned).double()
    wrapped = ORTModule(copy.deepcopy(reference))
    for batch in (3, 4, 5, 4):  # a fixed-size capture, then one with open sizes
        x = torch.randn(batch, 4, dtype=torch.float64)
        for module in (reference, wrapped):
            module.zero_grad()
        loss, _ = reference(x)
        loss.backward()
        loss, view = wrapped(x)
        view.mul_(3)  # eager refuses this at the backward; ortrain's copy keeps the gradient
        loss.backward()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, msg=f"{batch} {name}")


def test_a_write_into_a_returned_saved_tensor_is_refused_as_in_eager() -> None:
    torch.manual_seed(0)
    wrapped = ORTModule(_TanhHead("itself").double())
    for batch in (3, 4):
        loss, h = wrapped(torch.randn(batch, 4, dtype=torch.float64))
        h.mul_(3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
