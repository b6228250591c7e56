"""The LM head's gradients without the logits' gradient (passes/loss_head_gradient.py), end to end:
the rewrite fires on the tiny GPT's backward graph and training matches eager PyTorch."""

from __future__ import annotations

import logging

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side

from ortrain.models.tiny_gpt import GPTConfig, TinyGPT, TinyGPTLoss


@pytest.mark.parametrize("sparse", [True, False])
def test_tiny_gpt_trains_as_eager_with_the_rewrite(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, sparse: bool
) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", "1" if sparse else "0")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # the graphs stay in ONNX Runtime
    # the rewrite reads the loss's backward, which the linear cross-entropy fusion moves forward
    monkeypatch.setenv("ORTMODULE_FUSE_LINEAR_CROSS_ENTROPY", "0")
    torch.manual_seed(0)
    model = TinyGPTLoss(TinyGPT(GPTConfig(vocab_size=97, block_size=16, n_layer=1, n_head=2, d_model=16)))
    batches = []
    for step in range(3):
        idx = torch.randint(0, 97, (3, 16))
        targets = torch.roll(idx, -1, dims=1)
        targets[:, : 4 * step] = -100  # ignored labels, more at each step (none at the first)
        targets[0, -3:] = 5  # repeated targets: their head-weight rows add up
        batches.append((idx, targets))
    with caplog.at_level(logging.INFO, logger="ortrain.passes"):
        losses_ort, losses_eager, eager, wrapped = train_side_by_side(
            model, batches, lambda m, batch: m(*batch)
        )
    assert any("loss head: 1 gradient(s)" in record.getMessage() for record in caplog.records)
    assert ort_graph_count(wrapped) == 1
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
