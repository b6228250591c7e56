"""The quick GPT's captured forward and backward graphs, static and with a dynamic sequence
length, traced once for the export tests that compare what two ways of exporting them produce."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ortrain import bench
from ortrain.capture.aot_capture import Capture, capture


class _FlatCall(torch.nn.Module):
    """A built-in model (``model(*batch) -> loss``) as ORTModule hands models to ``capture``: over
    flat tensors, returning a tuple."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(*args),)


@pytest.fixture(scope="session")
def flat_call() -> Callable[[torch.nn.Module], torch.nn.Module]:
    """Wraps a built-in model of ``ortrain.bench`` for ``capture``."""
    return _FlatCall


@pytest.fixture(scope="session", params=[False, True], ids=["static", "dynamic"])
def quick_gpt_capture(request: pytest.FixtureRequest) -> Capture:
    """Export only reads these graphs (it copies them), so the tests share them."""
    model, batch = bench.build_model("gpt", bench.QUICK)
    dynamic = {0: (1,), 1: (1,)} if request.param else None
    return capture(_FlatCall(model), list(batch), training=True, dynamic_dims=dynamic)
