"""Token-embedding gradients with many repeated tokens equal eager's at every step.

ONNX Runtime's multi-threaded CPU ScatterND, which the exporter uses for an embedding's gradient,
lost additions to repeated ids (passes/scatter_nd_accumulation.py): without that pass this model
had a wrong token-embedding gradient in 3-9 of 40 steps on a busy 2-core machine. The failure is a
race, so a run of this test without the pass may pass by luck; with it, every step must match.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTModule
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT, TinyGPTLoss


def test_embedding_gradient_of_repeated_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # the backward stays in ONNX Runtime
    torch.manual_seed(0)
    # 12 ids in 8 x 128 tokens: each id repeats ~85 times; rows of 256 floats, enough for threads.
    model = TinyGPTLoss(TinyGPT(GPTConfig(vocab_size=12, block_size=128, n_layer=1, n_head=4, d_model=256)))
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    for step in range(8):
        idx = torch.randint(0, 12, (8, 128))
        targets = torch.roll(idx, -1, dims=1)
        for module in (wrapped, eager):
            module.zero_grad(set_to_none=True)
            module(idx, targets).backward()
        got = dict(wrapped.named_parameters())["model.tok.weight"].grad
        expected = dict(eager.named_parameters())["model.tok.weight"].grad
        torch.testing.assert_close(
            got, expected, rtol=1e-4, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}"
        )
