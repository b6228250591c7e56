"""The module-level values a forward reads (capture/global_reads.py), and the guards seeing them."""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.capture.global_reads import global_reads

TEMPERATURE = 1.0
SHIFT = 0.0
ACTIVATION = "tanh"
UNUSED = 3.0
settings = types.ModuleType("ortrain_test_settings")  # a config module the script imports
settings.SCALE = 1.0
settings.OTHER = 2.0


def _shifted(h: torch.Tensor) -> torch.Tensor:
    return h + SHIFT


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._activate(_shifted(self.lin(x) * settings.SCALE))

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) if ACTIVATION == "tanh" else F.relu(h)


class _Annealed(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) / TEMPERATURE).square().mean()


def test_reads_follow_helpers_methods_super_and_imported_modules() -> None:
    labels = {label for label, _, _ in global_reads(_Annealed)}
    here = __name__
    assert labels == {
        f"global {here}.TEMPERATURE",  # in forward
        f"global {here}.SHIFT",  # in a helper function of the file
        f"global {here}.ACTIVATION",  # in a method called on self
        "global ortrain_test_settings.SCALE",  # an imported module's attribute, through super()
    }
    assert global_reads(nn.Linear) == ()  # PyTorch's code is not followed


def test_a_changed_global_is_seen(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Wave 23: a module-level temperature annealed by the script stayed at its captured value."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    eager = _Annealed()
    wrapped = ORTModule(copy.deepcopy(eager))
    changes = {
        1: lambda: monkeypatch.setattr(f"{__name__}.TEMPERATURE", 0.5),
        2: lambda: monkeypatch.setattr(settings, "SCALE", 2.0),
        3: lambda: monkeypatch.setattr(f"{__name__}.ACTIVATION", "relu"),
        4: lambda: monkeypatch.setattr(f"{__name__}.UNUSED", 4.0),  # read by no forward: no capture
    }
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(5):
            if step in changes:
                changes[step]()
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            expected, got = eager(x), wrapped(x)
            expected.backward()
            got.backward()
            assert got.item() == pytest.approx(expected.item(), rel=1e-6), f"step {step}"
            for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad)
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    assert len(reasons) == 4, reasons
    assert f"global {__name__}.TEMPERATURE changed from 1.0 to 0.5" in reasons[1]
    assert "global ortrain_test_settings.SCALE changed from 1.0 to 2.0" in reasons[2]
    assert f"global {__name__}.ACTIVATION changed from 'tanh' to 'relu'" in reasons[3]
