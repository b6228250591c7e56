"""Example sizes for the exporter stay inside the range each size symbol's guards allow."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTModule


class _PreEmphasisThenReflectPad(nn.Module):
    """An audio front-end: ``x[:, 1:] - a * x[:, :-1]`` (one shorter), then a reflect pad of 32
    (as ``torch.stft(center=True)`` pads), which needs a length above 32."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.9))
        self.proj = nn.Linear(1, 3)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        x = wave[:, 1:] - self.alpha * wave[:, :-1]
        x = F.pad(x.unsqueeze(1), (32, 32), mode="reflect")
        return self.proj(x.transpose(1, 2)).pow(2).mean()


def test_a_reflect_pad_over_open_lengths_exports_its_backward(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The backward's example length was 17 whatever the guards said (the pad needs 34 or more):
    its export failed and the region ran in PyTorch. PyTorch's fake tensors also logged, at ERROR,
    the meta kernels the export tried before their decompositions."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _PreEmphasisThenReflectPad()
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (100, 120, 90):  # the second length captures with an open length
        wave = torch.randn(2, length)
        for module in (eager, wrapped):
            module.zero_grad()
            module(wave).backward()
        torch.testing.assert_close(wrapped.module.alpha.grad, eager.alpha.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wrapped.module.proj.weight.grad, eager.proj.weight.grad)
    assert "failed while attempting to run meta" not in capfd.readouterr().err


def test_example_values_stay_inside_bounded_ranges() -> None:
    from ortrain.export.fx_to_onnx import _free_value

    assert _free_value(set(), 34, None) == 37  # the first small prime the range allows
    assert _free_value({37}, 34, 40) == 40  # past the primes: from the top of the range
    assert _free_value(set(), 0, 16) == 16  # a size capped below the primes (a small table)
    assert _free_value(set(range(2, 11)), 2, 10) == 2  # every value taken: the lowest
