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
