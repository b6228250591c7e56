"""Means over nothing, as a loss over an empty selection takes them: NaN as in eager PyTorch, and no
failure of the capture (ortrain/capture/decompositions_losses.py, decompositions_math.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


class _MaskedRegression(nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 1)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        prediction = self.linear(x).squeeze(-1)
        return getattr(F, self.loss)(prediction[valid], y[valid])


@pytest.mark.parametrize("loss", ["mse_loss", "smooth_l1_loss", "huber_loss", "l1_loss"])
def test_a_loss_over_an_empty_selection_is_nan_and_the_model_stays_on_ort(loss: str) -> None:
    """Wave 30: mse, smooth L1 and Huber failed their capture there (PyTorch's decomposition of
    their backward divides by the element count in Python) and the model fell back to PyTorch for
    good; the mean of nothing was 0 on ONNX Runtime, NaN in eager PyTorch."""
    torch.manual_seed(0)
    eager = _MaskedRegression(loss)
    wrapped = ORTModule(copy.deepcopy(eager))
    for step in range(4):
        x, y = torch.randn(5, 6), torch.randn(5)
        valid = torch.zeros(5, dtype=torch.bool) if step == 2 else torch.tensor([1, 0, 1, 1, 0]).bool()
        got, expected = wrapped(x, y, valid), eager(x, y, valid)
        got.backward()
        expected.backward()
        torch.testing.assert_close(got, expected, equal_nan=True)
        torch.testing.assert_close(wrapped.linear.weight.grad, eager.linear.weight.grad)
        wrapped.zero_grad()
        eager.zero_grad()
    assert not wrapped._ortrain_fallback.active


class _Means(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * self.scale
        return h.mean(), h.mean(0), h.var(), h.std(0)


def test_the_mean_and_spread_of_an_empty_input_are_nan() -> None:
    wrapped = ORTModule(_Means())
    whole, per_column, variance, deviations = wrapped(torch.ones(0, 3))
    assert whole.isnan() and variance.isnan() and per_column.isnan().all() and deviations.isnan().all()
    assert per_column.shape == deviations.shape == (3,)
    x = torch.arange(6.0).reshape(2, 3)  # over something: the plain reductions
    # (A fresh wrapper: a second size would capture var's backward with the batch size left open,
    # whose export fails, a limit of its own.)
    for got, expected in zip(ORTModule(_Means())(x), _Means()(x), strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("loss", ["mse_loss", "smooth_l1_loss", "huber_loss"])
def test_the_loss_backwards_match_eager_in_bfloat16(loss: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written anew for the empty case, they compute in float32 and round, as PyTorch's kernels.
    (ONNX Runtime has no CPU kernels for bfloat16 matmuls: those run in PyTorch.)"""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    torch.manual_seed(0)
    eager = _MaskedRegression(loss).to(torch.bfloat16)
    wrapped = ORTModule(copy.deepcopy(eager))
    x, y = torch.randn(5, 6, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16)
    valid = torch.ones(5, dtype=torch.bool)
    wrapped(x, y, valid).backward()
    eager(x, y, valid).backward()
    torch.testing.assert_close(wrapped.linear.weight.grad, eager.linear.weight.grad)


class _TruthOverNoDimensions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * self.w
        keep = (h > 0).any(dim=()) & (h > -3).all(dim=())  # generic code handed an empty dims tuple
        return (h * keep).sum(), keep


def test_any_and_all_over_no_dimensions_reduce_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``any(dim=())`` is each element's truth in PyTorch; ONNX's reduction without axes reduces
    them all, and until wave 41 the graph's scalar broadcast into a wrong loss (or failed on its rank)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    eager = _TruthOverNoDimensions()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0], [-1.0, 2.0, -3.0, 4.0]])
    (got, got_keep), (expected, expected_keep) = wrapped(x), eager(x)
    got.backward()
    expected.backward()
    assert torch.equal(got_keep, expected_keep) and got.item() == expected.item()
    torch.testing.assert_close(wrapped.module.w.grad, eager.w.grad)


class _EmptySlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h[:, : x.shape[1] // 3].sum(1).sum() + h.square().mean()


def test_the_gradient_through_an_empty_slice_is_zero_as_in_eager(
    monkeypatch: pytest.MonkeyPatch, calls_like_eager: Callable[..., None]
) -> None:
    """``h[:, :T // 3]`` for a T under 3 is empty; its backward expands a gradient of 1 row to 0 rows,
    an ``Expand`` ONNX Runtime's ExpandElimination dropped, and the run failed (wave 41)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _EmptySlice()
    calls_like_eager(eager, ORTModule(copy.deepcopy(eager)), [torch.randn(2, n, 4) for n in (2, 6, 1)])


class _DroppedOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear(x)).pow(2).mean()


@pytest.mark.parametrize("sizes", [(0,), (4, 0), (4, 3, 0)])
def test_an_empty_batch_through_dropout_trains_as_eager(sizes: tuple[int, ...]) -> None:
    """PyTorch's dropout of an empty tensor returns its mask in the input's dtype, not bool: ONNX
    Runtime's backward, traced with a bool mask, refused it ("Unexpected input data type", wave
    48's review), under every fallback policy. An empty input is cast to its traced dtype now."""
    torch.manual_seed(0)
    eager = _DroppedOut()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    for step, size in enumerate(sizes):
        x = torch.randn(size, 4)
        losses = []
        for module in (wrapped, eager):
            module.zero_grad()
            torch.manual_seed(step)
            loss = module(x)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], equal_nan=True)
        torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad)


class _EmptySequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)  # (B, 0, 4) viewed as (0, 4) and back
        return h.square().sum() + x.flatten(0, 1).repeat(2, 3).sum()


@pytest.mark.parametrize("sizes", [((2, 0, 4), (2, 5, 4)), ((2, 5, 4), (2, 7, 4), (2, 0, 4), (2, 6, 4))])
def test_views_to_shapes_holding_zero_run_in_onnxruntime(sizes: tuple[tuple[int, ...], ...]) -> None:
    """onnxscript's ``Reshape`` without ``allowzero`` read a 0 in the target shape as "the input's
    size here": ``(2, 0, 4)`` to ``[0, 4]`` asked for ``[2, 4]`` (wave 48's review), and ONNX Runtime
    refused the region (an error under FALLBACK_DISABLE, as here; the model in PyTorch otherwise)."""
    torch.manual_seed(0)
    eager = _EmptySequence()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    for size in sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(len(size)))
        for module in (wrapped, eager):
            module.zero_grad()
            module(x).backward()
        torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad)
    assert not wrapped._ortrain_fallback.active
