"""BatchNorm's running statistics written by a captured graph keep their version counters, as eager's
kernel leaves them (ortrain/capture/running_statistics.py); other in-place writes still move them.

Wave 54's review: a backward that had saved the statistics before a captured graph wrote them
(eager's own BatchNorm backward, or a wrapped eval-mode call's graph) was refused with "is at
version 2; expected version 1", with a note blaming an optimizer step; eager runs both."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ortrain import ORTModule


def _step(model: nn.Module, body: Callable[[nn.Module], torch.Tensor]) -> tuple[torch.Tensor, list, list]:
    torch.manual_seed(1)
    loss = body(model)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    return loss.detach(), grads, buffers


def _assert_same(expected: tuple, got: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(got[2], expected[2], strict=True):  # running statistics, batch counts
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _eval_then_train(model: nn.Module) -> torch.Tensor:
    x = torch.randn(6, 4)
    model.eval()
    evaluated = model(x)
    model.train()
    trained = model(x)
    return (trained - evaluated.detach()).pow(2).mean() + evaluated.pow(2).mean()


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_an_eval_call_then_a_train_call_in_one_step_matches_eager() -> None:
    """The eval-mode graph saved the statistics; the train-mode call's write-back moved them."""
    model = _bn_model()
    expected = _step(copy.deepcopy(model), _eval_then_train)
    _assert_same(expected, _step(ORTModule(model), _eval_then_train))


def test_the_same_through_torch_compile_matches_eager() -> None:
    """The graph-break path's graphs (torch.compile(backend="ortrain")) write back alike."""
    model = _bn_model()
    expected = _step(copy.deepcopy(model), _eval_then_train)
    compiled = torch.compile(model, backend="ortrain")
    got = _step(compiled, _eval_then_train)
    _assert_same(expected, got)


class _Shared(nn.Module):
    """One BatchNorm on an eager path and in a tower that is wrapped; the eager call comes first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm1d(8)
        self.a = nn.Linear(4, 8, bias=False)
        self.tower = nn.Sequential(nn.Linear(4, 8, bias=False), self.bn)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.bn(self.a(x)) * self.tower(y)).mean()


def _shared_step(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(6, 4), torch.randn(6, 4))


def test_a_batch_norm_shared_with_an_eager_path_matches_eager() -> None:
    """Eager's own NativeBatchNormBackward saved the statistics the wrapped tower then wrote."""
    model = _Shared()
    expected = _step(copy.deepcopy(model), _shared_step)
    model.tower = ORTModule(model.tower)
    _assert_same(expected, _step(model, _shared_step))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(x)) * self.scale


@pytest.mark.parametrize("wrap", [False, True])
def test_a_buffer_written_before_the_backward_is_refused_and_named(wrap: bool) -> None:
    """A user's in-place write into a buffer the backward reads: eager refuses it, and so does
    ortrain (only the batch norms' own statistics writes keep their counters), naming the buffer
    rather than an optimizer step."""
    model = _Scaled()
    called = ORTModule(model) if wrap else model
    loss = called(torch.randn(6, 4)).pow(2).mean()
    with torch.no_grad():
        model.scale.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        loss.backward()
    if wrap:
        assert "Its buffer `scale` was written in place after this forward" in str(raised.value)
        assert "optimizer.step()" not in str(raised.value)
