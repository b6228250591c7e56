"""CTC loss trains under ORTModule when its lengths are fixed at capture (Python ints the model
holds, as the OpInfo sweep's samples). Its native op has a data-dependent output shape, so
capture failed before ortrain decomposed it (ortrain/capture/decompositions_ctc.py). Lengths
passed as tensors or as forward arguments still fail whole-graph capture: AOTAutograd's metadata
pass runs the native op on them; such a model trains through graph breaks, the loss in PyTorch."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn


class _Recognizer(nn.Module):
    def __init__(
        self, targets: torch.Tensor, input_lengths: list[int], target_lengths: list[int], reduction: str
    ) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.register_buffer("targets", targets)
        self.lengths = (input_lengths, target_lengths)
        self.ctc = nn.CTCLoss(blank=0, reduction=reduction, zero_infinity=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_probs = self.proj(x).log_softmax(-1)  # [T, N, C]
        return self.ctc(log_probs, self.targets, *self.lengths)


@pytest.mark.parametrize(("reduction", "concatenated"), [("mean", False), ("sum", True)])
def test_ctc_loss_trains_with_parity_entirely_in_onnxruntime(reduction: str, concatenated: bool) -> None:
    torch.manual_seed(0)
    targets = torch.randint(1, 5, (3, 4))
    targets[0, 1] = targets[0, 0]  # a repeated label needs a blank between
    input_lengths, target_lengths = [9, 7, 2], [4, 2, 3]  # the last cannot align: inf, zeroed
    if concatenated:
        targets = torch.cat([row[:n] for row, n in zip(targets, target_lengths, strict=True)])
    batches = [torch.randn(9, 3, 6) for _ in range(3)]
    model = _Recognizer(targets, input_lengths, target_lengths, reduction)
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x))
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert ort_graph_count(wrapped) == 1
