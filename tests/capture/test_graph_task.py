"""``backward_keeps_graph``: read from inside a node's backward, what the running backward was asked."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ortrain.capture.graph_task import backward_keeps_graph


class _Records(torch.autograd.Function):
    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Records.seen.append(backward_keeps_graph())
        return grad * 2


def test_it_says_whether_the_graph_is_kept() -> None:
    _Records.seen = []
    x = torch.ones(3, requires_grad=True)
    out = _Records.apply(x).sum()
    out.backward(retain_graph=True)
    out.backward()
    torch.autograd.grad(_Records.apply(x).sum(), x, create_graph=True)
    torch.autograd.grad(_Records.apply(x).sum(), x)
    assert _Records.seen == [True, False, True, False]
