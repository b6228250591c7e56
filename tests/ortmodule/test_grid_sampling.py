"""Spatial transformers: affine grids and grid sampling train as in eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTModule


class _SpatialTransformer(nn.Module):
    """A localization net whose last layer starts at the identity transform, as usual."""

    def __init__(self, mode: str, padding: str) -> None:
        super().__init__()
        self.mode, self.padding = mode, padding
        self.features = nn.Linear(12 * 12, 6)
        nn.init.zeros_(self.features.weight)
        with torch.no_grad():
            self.features.bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.features(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, mode=self.mode, padding_mode=self.padding, align_corners=False)


@pytest.mark.parametrize(
    ("mode", "padding"), [("bilinear", "zeros"), ("bilinear", "border"), ("nearest", "reflection")]
)
def test_a_spatial_transformer_from_the_identity_trains_as_eager(mode: str, padding: str) -> None:
    """At the identity grid every sample point is a pixel centre: the decomposed sampler took the
    grid's gradient from the neighbouring cell (off by 41, the largest gradient 36), and
    affine_grid's backward failed in ONNX Runtime ('Indices and updates must have the same rank')."""
    torch.manual_seed(0)
    eager = _SpatialTransformer(mode, padding)
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (wrapped, eager)]
    weights = torch.randn(2, 1, 12, 12)
    for _ in range(3):
        x = torch.randn(2, 1, 12, 12)
        for model, optimizer in zip((wrapped, eager), optimizers, strict=True):
            optimizer.zero_grad()
            (model(x) * weights).sum().backward()
        for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
            # Gradients in the hundreds: float32 rounding of theta (ONNX Runtime's Gemm after the
            # first step) moves them by ~1e-3 relative; the bug moved them by their own size.
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4 * b.grad.abs().max().item())
        for optimizer in optimizers:
            optimizer.step()


def test_a_spatial_transformer_at_new_batch_sizes_keeps_eagers_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a new batch size the capture leaves it open, and AOTAutograd's trace of affine_grid's
    backward failed on the symbolic size (the model fell back to PyTorch until wave 43). At the
    identity grid the sampler's gradient depends on the grid's last bit: PyTorch computes the grid
    at every size (a decomposed grid in ONNX Runtime moved gradients by 2.7x their size)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _SpatialTransformer("bilinear", "zeros")
    wrapped = ORTModule(copy.deepcopy(eager))
    for batch in (2, 3, 5):
        x, weights = torch.randn(batch, 1, 12, 12), torch.randn(batch, 1, 12, 12)
        for model in (wrapped, eager):
            model.zero_grad()
            (model(x) * weights).sum().backward()
        for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5 * b.grad.abs().max().item())
