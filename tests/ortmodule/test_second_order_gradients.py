"""Gradient penalties through ORTModule: the gradient with respect to an input, differentiated again."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTModule


def _critic(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "spectral_norm":  # power iteration writes its vectors at every training forward
        first: nn.Module = nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 8, 3, padding=1))
        return nn.Sequential(first, nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8 * 64, 1))
    # Dropout draws, BatchNorm writes its statistics: the recompute must start where the forward did.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.LeakyReLU(0.2),
        nn.BatchNorm2d(8),
        nn.Dropout(0.3),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.Softplus(),
        nn.Flatten(),
        nn.Linear(8 * 16, 1),
    )


def _r1_step(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """StyleGAN's R1: the squared gradient norm at real samples."""
    real = real.clone().requires_grad_(True)
    scores = critic(real)
    (grad,) = torch.autograd.grad(scores.sum(), real, create_graph=True)
    penalty = grad.pow(2).flatten(1).sum(1).mean()
    loss = F.softplus(-scores).mean() + F.softplus(critic(fake)).mean() + 5 * penalty
    return loss, penalty


def _wgan_gp_step(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """WGAN-GP: the gradient norm pulled to 1 between real and fake samples."""
    mix = torch.rand(real.shape[0], 1, 1, 1, generator=torch.Generator().manual_seed(7))
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty, penalty


@pytest.mark.parametrize(
    ("kind", "step"),
    [("dropout_batchnorm", _r1_step), ("spectral_norm", _wgan_gp_step), ("dropout_batchnorm", _wgan_gp_step)],
    ids=["r1-dropout-batchnorm", "wgan_gp-spectral_norm", "wgan_gp-dropout-batchnorm"],
)
def test_a_gradient_penalty_trains_like_eager(
    kind: str, step: Callable[..., tuple[torch.Tensor, ...]]
) -> None:
    """The penalty's gradient reaches the parameters through the second-order graph: losses,
    penalties, parameters and buffers equal eager's over several Adam steps (before, the step
    raised AOTAutograd's 'does not currently support double backward')."""
    eager = _critic(kind)
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (eager, wrapped)]
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        real, fake = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
        results = []
        for model, optimizer in zip((eager, wrapped), optimizers, strict=True):
            torch.manual_seed(100 + s)
            loss, penalty = step(model, real, fake)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            results.append((loss.detach(), penalty.detach()))
        assert results[1][1] > 0
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(list(wrapped.parameters()), list(eager.parameters()), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(list(wrapped.buffers()), list(eager.buffers()), rtol=1e-5, atol=1e-6)
    assert list(wrapped.graph_runners())  # the steps ran captured graphs, not the model's Python


def test_an_input_gradient_backward_keeps_pytorchs_retain_graph_rules() -> None:
    """On the ordinary path (an input requires grad, no create_graph) a retained graph backs up
    twice, like eager, and a third backward without it raises PyTorch's own error."""
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 6)
    grads = []
    for model in (eager, wrapped):
        xi = x.clone().requires_grad_(True)
        out = model(xi).sum()
        out.backward(retain_graph=True)
        out.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.backward()
        grads.append((xi.grad, *(p.grad for p in model.parameters())))
    torch.testing.assert_close(grads[1], grads[0])


class _WithWrappedBlock(nn.Module):
    """An eager model with one ORTModule block: the block's input is an activation, not a leaf."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(6, 8)
        block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))
        self.block = ORTModule(block) if wrap else block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.sin(self.pre(x)))


def test_a_penalty_through_a_wrapped_block_reaches_the_layers_before_it() -> None:
    eager, wrapped = _WithWrappedBlock(wrap=False), _WithWrappedBlock(wrap=True)
    for s in range(2):
        results = []
        for model in (eager, wrapped):
            torch.manual_seed(s)
            x = torch.randn(5, 6, requires_grad=True)
            y = model(x * 2)
            (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            model.zero_grad()
            (y.mean() + grad.pow(2).sum()).backward()
            results.append([p.grad for p in model.parameters()])
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_the_recompute_runs_under_the_forwards_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward under bfloat16 autocast and the penalty's gradient taken after the region ends:
    the recompute runs in bfloat16, as the forward did (in float32 the penalty's gradients were
    off by 2.6e-2)."""
    # ONNX Runtime's CPU build has no bfloat16 Conv or Gemm: those run in PyTorch, per operator.
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    torch.manual_seed(0)
    layers = (nn.Conv2d(3, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8 * 64, 1))
    eager = nn.Sequential(*layers)
    wrapped = ORTModule(copy.deepcopy(eager))
    grads = []
    for model in (eager, wrapped):
        real = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = model(real)
        assert scores.dtype == torch.bfloat16
        (grad,) = torch.autograd.grad(scores.float().sum(), real, create_graph=True)
        grad.float().pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == 3  # the conv's weight and bias, the linear's weight
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
