"""A tiny randomly initialised GPT-2 (tied ``wte``/``lm_head``) and an in-memory dataset."""

from __future__ import annotations

import torch

VOCAB = 100
SEQ = 16


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    # GPT-2's own dropout (0.1): ortrain draws eager's masks under the Trainer's seed, so the runs
    # still match. One block: these tests are about the Trainer's use of the model, and capture
    # and export time grows with the blocks (the parity zoo trains a two-block GPT-2).
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def token_dataset(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        mask = torch.ones(SEQ, dtype=torch.long)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
    return rows
