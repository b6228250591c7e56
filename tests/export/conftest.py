"""The quick GPT's captured forward and backward graphs, static and with a dynamic sequence
length, traced once for the export tests that compare what two ways of exporting them produce."""

from __future__ import annotations

import pytest
import torch

from ortrain import bench
from ortrain.capture.aot_capture import Capture, capture


class _LossOfFlat(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(idx, targets),)


@pytest.fixture(scope="session", params=[False, True], ids=["static", "dynamic"])
def quick_gpt_capture(request: pytest.FixtureRequest) -> Capture:
    """Export only reads these graphs (it copies them), so the tests share them."""
    model, batch = bench.build_model("gpt", bench.QUICK)
    dynamic = {0: (1,), 1: (1,)} if request.param else None
    return capture(_LossOfFlat(model), list(batch), training=True, dynamic_dims=dynamic)
