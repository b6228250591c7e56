"""The margin losses as PyTorch's kernels compute them: multilabel_margin_loss's target lists end at
the first -1, and neither loss takes a gradient where a hinge is exactly 0."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ortrain.capture.margin_losses import multi_margin_loss, multilabel_margin_loss

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


def _loss_and_gradient(loss: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (gradient,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), gradient


# Row 0's score 0 at class 2 is exactly the margin below its target's 1: a hinge of 0, where
# PyTorch's kernels take no gradient and clamp_min's passes one.
AT_THE_KINK = [[1.0, 1.0, 0.0, 1.0], [2.0, 0.5, 1.0, 1.0]]


def test_multilabel_margin_loss_takes_no_gradient_at_a_zero_hinge() -> None:
    x = torch.tensor(AT_THE_KINK, requires_grad=True)
    target = torch.tensor([[1, -1, 0, 0], [2, 0, -1, 0]])
    got = _loss_and_gradient(multilabel_margin_loss(x, target), x)
    torch.testing.assert_close(got, _loss_and_gradient(F.multilabel_margin_loss(x, target), x))
    assert got[1][0, 2] == 0


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize(
    "options",
    [{}, {"p": 2}, {"margin": 0.5}, {"weight": torch.tensor([1.0, 2.0, 3.0, 4.0])}],
    ids=["p1", "p2", "margin", "weight"],
)
def test_multi_margin_loss_matches_pytorchs_kernel(options: dict, reduction: str) -> None:
    x = torch.tensor(AT_THE_KINK, requires_grad=True)
    if "margin" in options:
        x = (x * 0.5).detach().requires_grad_()  # the kink again: 0.5 below the target's 0.5
    target = torch.tensor([1, 2])
    got = _loss_and_gradient(multi_margin_loss(x, target, reduction=reduction, **options), x)
    expected = _loss_and_gradient(F.multi_margin_loss(x, target, reduction=reduction, **options), x)
    torch.testing.assert_close(got, expected)
    random = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    labels = torch.tensor([4, 0, 2])
    weight = {"weight": torch.arange(1.0, 6.0)} if "weight" in options else {}
    options = {**options, **weight}
    torch.testing.assert_close(
        _loss_and_gradient(multi_margin_loss(random, labels, reduction=reduction, **options), random),
        _loss_and_gradient(F.multi_margin_loss(random, labels, reduction=reduction, **options), random),
    )


def test_multi_margin_loss_on_one_row_and_its_refusals() -> None:
    x = torch.tensor([1.0, 1.0, 0.0, 1.0])
    for target in (torch.tensor(1), torch.tensor([1])):
        got = multi_margin_loss(x, target, reduction="none")
        expected = F.multi_margin_loss(x, target, reduction="none")
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(
        multi_margin_loss(x[None], torch.tensor([1]), size_average=False),
        F.multi_margin_loss(x[None], torch.tensor([1]), reduction="sum"),
    )
    # p other than 1 or 2: left to PyTorch, which refuses it with its own message
    assert multi_margin_loss(x[None], torch.tensor([1]), p=3) is NotImplemented
