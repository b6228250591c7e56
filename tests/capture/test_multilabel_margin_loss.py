"""multilabel_margin_loss as PyTorch's kernel computes it (its decomposition ignores the -1 end)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ortrain.capture.multilabel_margin_loss import multilabel_margin_loss

TARGETS = {
    "ends early": [[0, 3, -1, 0, 0], [4, -1, 1, 1, 1], [-1, 2, 2, 2, 2]],
    "no end": [[0, 3, 1, 2, 4], [4, 1, 1, 1, 1], [2, 2, 0, 0, 0]],
    "repeats before the end": [[1, 1, 3, -1, 4], [0, 0, -1, 2, 2], [2, 4, 2, -1, 0]],
}


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("targets", list(TARGETS), ids=str)
def test_loss_and_gradient_match_pytorchs_kernel(targets: str, reduction: str) -> None:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    target = torch.tensor(TARGETS[targets])
    ours, eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = multilabel_margin_loss(ours, target, reduction=reduction)
    expected = F.multilabel_margin_loss(eager, target, reduction=reduction)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(ours.grad, eager.grad)


def test_an_unbatched_row_and_the_legacy_arguments() -> None:
    x, target = torch.randn(5), torch.tensor([3, 0, -1, 1, 1])
    torch.testing.assert_close(
        multilabel_margin_loss(x, target, reduction="none"),
        F.multilabel_margin_loss(x, target, reduction="none"),
    )
    batch, targets = torch.randn(2, 5), torch.tensor(TARGETS["ends early"][:2])
    torch.testing.assert_close(
        multilabel_margin_loss(batch, targets, size_average=False),
        F.multilabel_margin_loss(batch, targets, reduction="sum"),
    )
