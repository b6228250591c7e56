"""Gradients near float32's limit overflow where eager's do, not sooner: a loss scaler grows its
scale until they do, and skips those steps (ortrain/runtime/executors/ort.py, DISABLED_OPTIMIZERS)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _MeanOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).mean()


def test_a_mean_scaled_near_float32s_limit_has_eagers_finite_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wave 47's review: ONNX Runtime's MatMulScaleFusion folded the mean's 1/N into the weight
    gradient's MatMul, which formed an N-times larger product first: infinite from a scale 4096 times
    below eager's first overflow (a GradScaler skipped steps eager runs)."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # ONNX Runtime runs the graphs
    torch.manual_seed(0)
    eager = _MeanOutput()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(1024, 8)
    for scale in (1.0, 1e36):
        for model in (eager, wrapped):
            model.zero_grad()
            (model(x) * scale).backward()
        for name, p in eager.named_parameters():
            assert torch.isfinite(p.grad).all()
            # (rtol: ONNX Runtime sums the 1024 rows in another order, README "Long sums")
            torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, rtol=1e-5, atol=0, msg=name)
