"""A graph captured for the same tensor passed twice is not reused for distinct tensors, nor the
reverse: AOTAutograd captures one input for the two, a different function of the inputs."""

from __future__ import annotations

import copy

import torch

from ortrain import ORTModule
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT, TinyGPTLoss


def test_same_tensor_twice_then_distinct_tensors_match_eager() -> None:
    torch.manual_seed(0)
    eager = TinyGPTLoss(TinyGPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, d_model=16)))
    wrapped = ORTModule(copy.deepcopy(eager))
    b, c = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    for args in ((b, b), (b, c), (c, c), (c, b)):  # idx and targets: one tensor, then two
        want = eager(*args)
        want.backward()
        got = wrapped(*args)
        got.backward()
        torch.testing.assert_close(got, want)
        for (name, p), q in zip(eager.named_parameters(), wrapped.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
        eager.zero_grad()
        wrapped.zero_grad()
