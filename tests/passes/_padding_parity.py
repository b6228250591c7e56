"""Padding elimination on a traced forward, run eagerly in float64 against the model: the loss and
every gradient must be the model's."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ortrain.capture.forward_rewrite import trace_forward
from ortrain.passes.padding_elimination import eliminate_padding

V, D, PAD = 30, 8, 0


class _Flat(nn.Module):
    """As ORTModule calls a model: flat tensors in, a tuple out."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.module(*tensors),)


def eliminate_and_compare(model: nn.Module, inputs: list[torch.Tensor]) -> list[str]:
    """Padding elimination on the traced forward; the rewritten graph's loss and gradients must be
    the model's."""
    flat = _Flat(model.double())
    trace = trace_forward(flat, inputs)
    assert trace is not None
    gm = trace.graph_module
    changes = eliminate_padding(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    reference = copy.deepcopy(flat)
    expected = reference(*inputs)[0]
    expected.backward()
    state = [t for _, t in (*flat.named_parameters(remove_duplicate=False), *flat.named_buffers())]
    got = gm(state, *inputs)[0]
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(flat.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return changes


def padded(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids of random lengths (one row fully real) and labels ignoring the pads."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (rows, length), generator=generator)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    lengths[0] = length
    ids = ids.masked_fill(torch.arange(length)[None] >= lengths[:, None], PAD)
    labels = torch.randint(0, V, (rows, length), generator=generator).masked_fill(ids == PAD, -100)
    return ids, labels
