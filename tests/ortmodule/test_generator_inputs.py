"""A ``torch.Generator`` passed to the forward (``forward(x, generator=g)``, as diffusion pipelines do)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.ortmodule import ortmodule


class _NoisedRegression(nn.Module):
    """Noise and a time drawn inside the forward, from the generator given, else the global one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=generator)
        t = torch.rand(x.shape[0], 1, generator=generator)
        return (self.net(torch.cat([(1 - t) * x + t * noise, t], 1)) - noise).pow(2).mean()


def test_only_the_calls_that_pass_a_generator_run_in_pytorch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the default policy. Until wave 53 one call with a generator sent the model to PyTorch
    for good ("cannot pass input 'generator' (a Generator)"), the calls without one too."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    ortmodule._warn_once_generator_input.cache_clear()  # once per process: another test's aside
    torch.manual_seed(0)
    eager = _NoisedRegression()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    results = []
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for model in (eager, wrapped):
            generator = torch.Generator().manual_seed(42)
            torch.manual_seed(3)
            losses = []
            for with_generator in (False, True, True, False):
                loss = model(x, generator=generator) if with_generator else model(x)
                loss.backward()
                losses.append(loss.detach())
            results.append((losses, [p.grad for p in model.parameters()], generator.get_state()))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    assert not wrapped._ortrain_fallback.active and list(wrapped.graph_runners())
    warned = [r.getMessage() for r in caplog.records if "torch.Generator" in r.getMessage()]
    assert len(warned) == 1 and "(input 'generator')" in warned[0]
    assert "calls without one run on the graphs" in warned[0]


def test_under_fallback_disable_a_generator_is_refused_saying_what_to_do() -> None:
    wrapped = ORTModule(_NoisedRegression())
    x = torch.randn(8, 4)
    wrapped(x).backward()
    with pytest.raises(RuntimeError, match="hold the generator on the model"):
        wrapped(x, generator=torch.Generator().manual_seed(0))
    wrapped(x).backward()
    assert not wrapped._ortrain_fallback.active
