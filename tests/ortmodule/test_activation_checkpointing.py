"""Activation checkpointing (``torch.utils.checkpoint``) under ORTModule.

By default a checkpointed region is traced into the graphs and recomputed in the backward graph,
so the saving in memory survives; with ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1 reentrant regions
run in PyTorch as python ops, as upstream did.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from test_custom_autograd_function import python_op_counts
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts

from ortrain.ortmodule import ORTModule, ORTModuleTorchModelException


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)).sin()) + x


class Net(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.mode == "sequential":
            return checkpoint_sequential(self.blocks, 3, x, use_reentrant=False).square().mean()
        for block in self.blocks:
            if self.mode == "none":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x.square().mean()


def bytes_saved_for_backward(model: ORTModule) -> int:
    """Activations the forward graph hands to the backward graph.

    Every backward input except the output gradients (``tangents``) and the forward's own inputs
    (``primals``: parameters and the batch), which the backward reads in place, not as copies.
    """
    (entries,) = model._ortrain_graphs.values()
    backward = entries[0].capture.backward.graph
    total = 0
    for node in backward.graph.nodes:
        value = node.meta.get("val")
        is_saved = node.op == "placeholder" and not node.name.startswith(("tangents", "primals"))
        if is_saved and isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def _train(mode: str) -> ORTModule:
    torch.manual_seed(0)
    batches = [torch.randn(32, 16) for _ in range(2)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(Net(mode), batches, lambda m, b: m(b))
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-6)
    assert_same_state(eager, wrapped, atol=1e-5)
    return wrapped


def test_checkpointed_regions_are_recomputed_in_the_backward_graph() -> None:
    baseline = bytes_saved_for_backward(_train("none"))
    for mode in ("reentrant", "non_reentrant", "sequential"):
        wrapped = _train(mode)
        saved = bytes_saved_for_backward(wrapped)
        # Only each block's input (and the weights) cross; the 32x64 activations are recomputed.
        # checkpoint_sequential leaves its last segment uncheckpointed, by design.
        limit = 0.5 if mode == "sequential" else 0.2
        assert saved < limit * baseline, (mode, saved, baseline)
        assert python_op_counts(wrapped) == [(0, 0)], mode  # all of it runs in ONNX Runtime


def test_allow_autograd_checkpoint_runs_reentrant_regions_as_python_ops(monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "1")
    wrapped = _train("reentrant")
    assert python_op_counts(wrapped) == [(3, 3)]


def test_selective_checkpointing_is_refused_naming_the_variable() -> None:
    def policy(ctx, op, *args, **kwargs):
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    class Selective(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def context():
                return create_selective_checkpoint_contexts(policy)

            return checkpoint(self.blocks[0], self.inp(x), use_reentrant=False, context_fn=context).sum()

    with pytest.raises(ORTModuleTorchModelException, match="ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT"):
        ORTModule(Selective("none"))(torch.randn(4, 16))


class _DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


class _FrozenInputBlocks(nn.Module):
    """Reentrant checkpoints whose inputs need no gradient: eager runs them without a graph (its
    blocks get no gradients, with a warning) and the head trains on their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_DropoutBlock() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return nn.functional.cross_entropy(self.head(x), y)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_a_reentrant_region_without_gradients_keeps_its_dropout_masks() -> None:
    """Wave 28: dropout's outputs were tagged for recomputation while the op itself was to be
    saved; the partitioner re-ran the op in the backward graph, drawing other masks, and the head
    got its gradient from other activations than the forward's: 0.2 off, silently."""
    torch.manual_seed(0)
    eager = _FrozenInputBlocks()
    wrapped = ORTModule(copy.deepcopy(eager))
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for step in range(3):
        results = []
        for model in (eager, wrapped):
            torch.manual_seed(step)
            loss = model(x, y)
            loss.backward()
            results.append((loss.detach(), [p.grad for p in model.parameters()]))
            model.zero_grad()
        (loss_e, grads_e), (loss_o, grads_o) = results
        torch.testing.assert_close(loss_o, loss_e)
        for a, b in zip(grads_e, grads_o, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


class _NormalizedFrozenInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=True)).pow(2).mean()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_a_reentrant_region_without_gradients_is_saved_not_recomputed() -> None:
    """Wave 47's review: such a region was still tagged for recomputation, and the backward
    computed it again from the BatchNorm statistics the forward had updated ("modified by an
    inplace operation" at the first backward)."""
    torch.manual_seed(0)
    eager = _NormalizedFrozenInput().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(2):
        x = torch.randn(6, 8, dtype=torch.float64)
        for model in (eager, wrapped):
            model.zero_grad()
            model(x).backward()
        assert wrapped.module.block[0].weight.grad is None
        torch.testing.assert_close(wrapped.module.head.weight.grad, eager.head.weight.grad)
        torch.testing.assert_close(wrapped.module.block[2].running_var, eager.block[2].running_var)


def test_a_reentrant_region_without_gradients_warns_as_eager() -> None:
    """Eager warns that the region's gradients will be None (adapters inside checkpointed blocks of
    a frozen model, without ``enable_input_require_grads``): the capture never showed it (wave 50's
    review)."""
    wrapped = ORTModule(_FrozenInputBlocks())
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        wrapped(torch.randn(6, 8), torch.randint(0, 4, (6,))).backward()
    assert wrapped.module.blocks[0].lin.weight.grad is None
    assert wrapped.module.head.weight.grad is not None
