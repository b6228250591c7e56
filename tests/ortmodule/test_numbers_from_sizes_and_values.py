"""Sizes computed with //, % and ceil from a changing length, and numbers read off tensors with
``.item()``, train in ONNX Runtime with eager's losses and gradients (FALLBACK_DISABLE: nothing may
run in PyTorch but what it runs by design)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _PairsMerged(nn.Module):
    """Time steps merged in pairs, an odd last one dropped: sizes ``(T - T % 2) // 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        x = x[:, : t - t % 2]
        return self.linear(x.reshape(b, (t - t % 2) // 2, 2 * c)).pow(2).mean()


class _Chunks(nn.Module):
    """Padded up to whole chunks of 3: ``math.ceil(T / 3)`` chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = math.ceil(x.shape[1] / 3)
        x = F.pad(x, (0, 0, 0, chunks * 3 - x.shape[1]))
        return self.linear(x.view(x.shape[0], chunks, 3, 4).mean(2)).pow(2).mean()


class _StridedConvolutions(nn.Module):
    """Strided convolutions and pooling over a changing length: whether the stride divides it
    varies, and with it the output padding of the input gradient's transposed convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv1d(4, 8, 5, stride=2, padding=1), nn.ReLU(), nn.MaxPool1d(3), nn.Conv1d(8, 8, 3, stride=2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.transpose(1, 2)).pow(2).mean()


class _FlattenedScores(nn.Module):
    """Self-attention's (T, T) scores flattened: a size ``T**2``, which the exporter could not
    write (XLM's backward: 280 nodes in PyTorch)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.linear(x)
        scores = F.softmax((h @ h.transpose(1, 2)).reshape(b, t * t), dim=-1).reshape(b, t, t)
        return (scores @ h).pow(2).mean()


class _Halves(nn.Module):
    """Split in chunks of ``T // 2``: a computed chunk size, on which onnxscript's constant folding
    of ``SplitToSequence`` failed (ProphetNet's forward: 141 nodes in PyTorch)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        first, second = h.split(h.shape[1] // 2, dim=1)[:2]
        return first.pow(2).mean() + 2 * second.pow(2).mean()


def test_sizes_with_floor_division_remainder_and_ceiling_of_a_changing_length_match_eager() -> None:
    """The executor evaluated such sizes with sympy.lambdify, which knows none of PyTorch's size
    functions (NameError: FloorDiv), the exporter could not write them, and the backward takes
    ``T`` only as a number (no input tensor has it as a size): each model trained in PyTorch from
    its second length on, after one warning, and FALLBACK_DISABLE refused it."""
    models = (_PairsMerged(), _Chunks(), _StridedConvolutions(), _FlattenedScores(), _Halves())
    for model in models:
        torch.manual_seed(0)
        batches = [torch.randn(2, length, 4) for length in (40, 53, 61, 46)]
        losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        assert_same_state(wrapped, eager, atol=1e-5)
        assert wrapped._ortrain_graph_breaks is None


class _ScaledByRootLength(nn.Module):
    """Scores scaled by ``math.sqrt`` of the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) / math.sqrt(x.shape[1])).sum(1).pow(2).mean()


def test_math_sqrt_of_a_changing_length_keeps_one_graph_with_pythons_value() -> None:
    """``math.sqrt(T)`` asked the size for a float, which fixed it: a capture per length (wave 50's
    review); as ``torch.sym_sqrt`` it stays open, computed in float64 as Python does."""
    torch.manual_seed(0)
    batches = [torch.randn(2, length, 4, dtype=torch.float64) for length in (8, 12, 16, 21)]
    model = _ScaledByRootLength().double()
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-13, atol=0)
    for got, want in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    assert sum(len(group) for group in wrapped._ortrain_graphs.values()) == 2  # static, then open
    assert math.sqrt is not None and math.sqrt(16) == 4.0 and type(math.sqrt(2)) is float


class _TokenNormalized(nn.Module):
    """The loss summed over counted tokens and divided by their count, read with ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        counted = (labels != -100).sum().item()
        loss = F.cross_entropy(
            self.linear(x).view(-1, 5), labels.view(-1), ignore_index=-100, reduction="sum"
        )
        return loss / counted


class _Warmup(nn.Module):
    """A factor from a step buffer's ``.item()``, which the backward reads too (a SymFloat)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.step += 1
        scale = min(1.0, self.step.item() / 3)
        torch._check(self.step.item() < 100)
        return (self.linear(x) * scale).pow(2).mean() + 0 * labels.sum()


def test_numbers_read_with_item_match_eager_in_onnxruntime() -> None:
    """The forward returned the count as a number its backward needed, which ONNX could not express
    ("no input or output tensor has u2 as a dim"), and a saved float came back from ONNX Runtime as
    a tensor where AOTAutograd wants a number: the whole model ran in PyTorch, or crashed from the
    second step; ``torch._check`` had no translation."""
    for model in (_TokenNormalized(), _Warmup()):
        torch.manual_seed(0)
        batches = [(torch.randn(2, 3, 4), torch.randint(0, 5, (2, 3))) for _ in range(4)]
        for step, (_, labels) in enumerate(batches):
            labels.view(-1)[step : step + 3] = -100  # another count each step
        losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, b: m(*b))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        assert_same_state(wrapped, eager, atol=1e-5)


class _NumpyInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = float(np.clip(x.detach().abs().mean().numpy(), 0.5, 2.0))
        return (self.linear(x) * weight).pow(2).mean()


def test_numpy_in_forward_trains_through_graph_breaks() -> None:
    """``.numpy()`` reads values; the capture's error was not recognised as data-dependent, so the
    model was refused (FALLBACK_DISABLE) or ran in PyTorch, where graph breaks handle it."""
    torch.manual_seed(0)
    batches = [torch.randn(3, 4) * (i + 1) for i in range(3)]
    losses, expected, eager, wrapped = train_side_by_side(_NumpyInForward(), batches, lambda m, x: m(x))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    assert_same_state(wrapped, eager, atol=1e-5)
    assert wrapped._ortrain_graph_breaks is not None


class _WeightNormalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1), dim=2)
        self.old = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.old(self.conv(x).transpose(1, 2)).pow(2).mean()


def test_weight_norm_trains_in_onnxruntime() -> None:
    """``_weight_norm_interface_backward`` had no translation (Wav2Vec2's positional convolution)."""
    torch.manual_seed(0)
    batches = [torch.randn(2, 4, 6) for _ in range(3)]
    losses, expected, eager, wrapped = train_side_by_side(_WeightNormalized(), batches, lambda m, x: m(x))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    assert_same_state(wrapped, eager, atol=1e-5)


class _CountsRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum() / len(x)  # len() makes the size a Python int


def test_a_size_the_model_fixes_is_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    model = ORTModule(_CountsRows())
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for rows in (2, 3, 5):
            model(torch.randn(rows, 4)).backward()
    assert any("fixed sizes the capture left open (input 0 dim 0" in r.getMessage() for r in caplog.records)
    assert len([e for entries in model._ortrain_graphs.values() for e in entries]) == 3
