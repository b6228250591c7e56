"""A parameter or input written in place between a call and its backward: where eager's backward
reads the old value it raises, and so does ortrain's; where no gradient reads it, both run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.query = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embedding(tokens) + x)
        h = h + F.scaled_dot_product_attention(self.query(h)[:, None], h[:, None], h[:, None])[:, 0]
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return F.gelu(self.head(h)).pow(2).mean()


def _backward_after_a_write(model: nn.Module, wrap: bool, written: str) -> list[torch.Tensor | None] | str:
    """The gradients, or the error's text, of one call whose ``written`` tensor is changed in place
    before its backward."""
    called = ORTModule(model) if wrap else model
    tokens = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = called(tokens, x)
    with torch.no_grad():
        (x if written == "x" else model.get_parameter(written)).mul_(1.5)
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)
    return [p.grad for p in model.parameters()] + [x.grad]


@pytest.mark.parametrize("written", ["embedding.weight", "query.bias", "conv.bias", "head.bias", "x"])
def test_a_write_no_gradient_reads_is_allowed_as_in_eager(written: str) -> None:
    """Wave 37: ORTModule's node saved every parameter for the second-order path and checked them
    all at each backward, so writing one that no gradient reads (an embedding table updated in
    place between forward and backward) raised "modified by an inplace operation" where eager
    runs."""
    torch.manual_seed(0)
    model = _Block()
    expected = _backward_after_a_write(copy.deepcopy(model), False, written)
    got = _backward_after_a_write(model, True, written)
    assert not isinstance(expected, str) and not isinstance(got, str), got
    for ours, theirs in zip(got, expected, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("written", ["norm.weight", "query.weight", "conv.weight", "head.weight"])
def test_a_write_a_gradient_reads_raises_as_in_eager(written: str) -> None:
    torch.manual_seed(0)
    model = _Block()
    expected = _backward_after_a_write(copy.deepcopy(model), False, written)
    got = _backward_after_a_write(model, True, written)
    assert isinstance(expected, str) and "modified by an inplace operation" in expected
    assert isinstance(got, str) and "modified by an inplace operation" in got


def test_the_second_order_path_still_refuses_a_written_parameter() -> None:
    """With create_graph=True the backward recomputes the forward from the saved tensors, which
    must be the forward's: a write to any of them raises."""
    model = ORTModule(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    x = torch.randn(3, 4, requires_grad=True)
    loss = model(x).pow(2).sum()
    with torch.no_grad():
        model.module[0].bias.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, x, create_graph=True)


class _ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.pi, self.v = nn.Linear(6, 32), nn.Linear(32, 3), nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(obs))
        return self.pi(h), self.v(h).squeeze(-1)


def test_an_optimizer_step_between_two_backwards_says_what_to_do() -> None:
    """The actor's step between the actor's and the critic's backward: eager runs it, the captured
    graph (one node that saved the head's weight) refuses it; the error now says why and what to
    do (wave 45's review: AOTAutograd's message alone named neither)."""
    wrapped = ORTModule(_ActorCritic())
    actor = torch.optim.SGD(wrapped.module.pi.parameters(), lr=0.1)
    logits, value = wrapped(torch.randn(4, 6))
    logits.logsumexp(-1).mean().backward(retain_graph=True)
    actor.step()
    with pytest.raises(RuntimeError, match="step the optimizers after the last backward") as raised:
        value.pow(2).mean().backward()
    assert "Its weights `pi.weight`, `pi.bias` were changed in place" in str(raised.value)
