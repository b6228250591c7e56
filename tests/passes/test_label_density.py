"""Label sparsity where the captured batch's labels are sparse, not where every label counts."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class Classifier(nn.Module):
    """A head feeding cross-entropy (the fused head and loss), and a plain loss on other logits."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)
        self.fused = fused

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.body(x)))
        if not self.fused:
            logits = logits * 2.0  # not a linear's output: label sparsity's own gather
        return F.cross_entropy(logits, y)


def _labels(step: int, ignored: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    y = torch.randint(0, 5, (20,), generator=g)
    y[: int(20 * ignored)] = -100
    return torch.randn(20, 8, generator=g), y


def _rewrites_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ortrain.passes"]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "plain-loss"])
@pytest.mark.parametrize(
    ("first", "sparse"), [(0.0, False), (0.1, False), (0.15, True), (0.5, True)], ids=lambda v: str(v)
)
def test_the_captured_batch_decides_and_every_later_batch_matches_eager(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, fused: bool, first: float, sparse: bool
) -> None:
    """Labels under 90 % counted at capture get the gather; a graph built either way gives eager's
    loss and gradients for batches of any density after it, none counted included."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    eager = Classifier(fused)
    model = ORTModule(copy.deepcopy(eager))
    with caplog.at_level(logging.INFO, logger="ortrain.passes"):
        for step, ignored in enumerate([first, 0.5, 0.0, 1.0]):
            x, y = _labels(step, ignored)
            expected, got = eager(x, y), model(x, y)
            expected.backward()
            got.backward()
            torch.testing.assert_close(got, expected, equal_nan=True)
            for theirs, ours in zip(eager.parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(ours.grad, theirs.grad)
                theirs.grad = ours.grad = None
    logged = _rewrites_logged(caplog)
    dense = [line for line in logged if "left dense" in line]
    if sparse:
        assert not dense, logged
        assert any("counted rows" in line for line in logged), logged
    else:
        share = f"{1 - first:.0%}"
        assert dense == [
            f"label sparsity: {dense[0].split()[2]} left dense ({share} of the captured batch's "
            "labels count; it pays under 90%)"
        ], logged
        assert not any("counted rows" in line for line in logged), logged


class ComputedLabels(nn.Module):
    """Labels the model computes (masking its own pad class): their density is known only when the
    graph runs, so the gather is written as before."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), y.masked_fill(y == 0, -100))


def test_labels_the_model_computes_keep_the_gather(caplog: pytest.LogCaptureFixture) -> None:
    x, y = _labels(0, 0.0)
    y = y.clamp(min=1)  # every label counts in this batch, yet the model's mask is not followed
    with caplog.at_level(logging.INFO, logger="ortrain.passes"):
        ORTModule(ComputedLabels())(x, y).backward()
    logged = _rewrites_logged(caplog)
    assert any("counted rows" in line for line in logged), logged
    assert not any("left dense" in line for line in logged), logged
