"""CTC loss trains under ORTModule entirely in ONNX Runtime. Its native op has an output shape
that depends on the target lengths' values, so capture failed; ortrain now replaces
``F.ctc_loss`` while capturing (ortrain/capture/function_overrides.py, decompositions_ctc.py)."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn


class _Recognizer(nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.ctc = nn.CTCLoss(blank=0, reduction=reduction, zero_infinity=True)

    def forward(self, x, targets, input_lengths, target_lengths):  # type: ignore[no-untyped-def]
        log_probs = self.proj(x).log_softmax(-1)  # [T, N, C]
        return self.ctc(log_probs, targets, input_lengths, target_lengths)


@pytest.mark.parametrize(("reduction", "concatenated"), [("mean", False), ("sum", True)])
def test_ctc_loss_trains_with_parity_entirely_in_onnxruntime(reduction: str, concatenated: bool) -> None:
    """Padded targets with tensor lengths as forward inputs; concatenated targets with lengths
    as Python lists (constants of the graph: their split needs the values)."""
    torch.manual_seed(0)
    targets = torch.randint(1, 5, (3, 4))
    targets[0, 1] = targets[0, 0]  # a repeated label needs a blank between
    # Time steps: 6, the least with a choice of paths for the first target (4 labels and the
    # blank its repeat needs); the lattice is unrolled per step, so export time grows with them.
    input_lengths, target_lengths = [6, 4, 2], [4, 2, 3]  # the last cannot align: inf, zeroed
    lengths: tuple = (torch.tensor(input_lengths), torch.tensor(target_lengths))
    if concatenated:
        targets = torch.cat([row[:n] for row, n in zip(targets, target_lengths, strict=True)])
        lengths = (input_lengths, target_lengths)
    batches = [torch.randn(6, 3, 6) for _ in range(2)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        _Recognizer(reduction), batches, lambda m, x: m(x, targets, *lengths)
    )
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert ort_graph_count(wrapped) == 1


class _Aligner(nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)
        self.reduction = reduction

    def forward(self, x, targets, input_lengths, target_lengths):  # type: ignore[no-untyped-def]
        log_probs = self.proj(x).log_softmax(-1)
        return nn.functional.ctc_loss(
            log_probs, targets, input_lengths, target_lengths, reduction=self.reduction
        )


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_a_sample_no_alignment_fits_gets_pytorchs_nan_gradients(reduction: str) -> None:
    """Without ``zero_infinity``, PyTorch's backward gives an infinite sample NaN gradients on its
    steps (0 beyond them); the recursion's autograd gave zeros there until wave 35, so a model
    trained on where eager's updates are NaN."""
    from ortrain import ORTModule

    torch.manual_seed(0)
    targets = torch.tensor([[1, 1, 1, 2, 3], [1, 2, 0, 0, 0]])
    lengths = (torch.tensor([4, 6]), torch.tensor([5, 2]))  # the first needs 7 steps, has 4
    scores = torch.randn(6, 2, 5)

    def loss(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x = scores.clone().requires_grad_()
        value = model(x, targets, *lengths)
        return value.detach(), torch.autograd.grad(value.sum(), [x])[0]

    model = _Aligner(reduction)
    (expected, expected_grad), (got, got_grad) = loss(model), loss(ORTModule(model))
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert expected_grad[:4, 0].isnan().all() and not expected_grad[4:, 0].isnan().any()
    torch.testing.assert_close(got_grad, expected_grad, equal_nan=True)
