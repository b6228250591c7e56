"""CTC loss trains under ORTModule entirely in ONNX Runtime. Its native op has an output shape
that depends on the target lengths' values, so capture failed; ortrain now replaces
``F.ctc_loss`` while capturing (ortrain/capture/function_overrides.py, decompositions_ctc.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn

from ortrain.runtime.executors.base import fx_target_name
from ortrain.runtime.executors.ort import OnnxRuntimeExecutor
from ortrain.runtime.graph_executor import PlanRunner


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
    (entry,) = (e for group in wrapped._ortrain_graphs.values() for e in group)
    # PyTorch checks the input lengths (eager's error: see below); ONNX Runtime runs the rest.
    assert _runs_in_torch(entry.capture.forward.runner) == ["aten._assert_async.msg"]
    assert _runs_in_torch(entry.capture.backward.runner) == []


def _runs_in_torch(runner: PlanRunner) -> list[str]:
    return [
        fx_target_name(node)
        for step in runner.plan.steps
        if not isinstance(step.executor, OnnxRuntimeExecutor)
        for node in step.nodes
        if node.op == "call_function"
    ]


class _Aligner(nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)
        self.reduction = reduction

    def forward(self, x, targets, input_lengths, target_lengths):  # type: ignore[no-untyped-def]
        log_probs = self.proj(x).log_softmax(-1)
        return nn.functional.ctc_loss(
            log_probs, targets, input_lengths, target_lengths, reduction=self.reduction
        )


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_a_sample_no_alignment_fits_gets_pytorchs_nan_gradients(reduction: str) -> None:
    """Without ``zero_infinity``, PyTorch's backward gives an infinite sample NaN gradients on its
    steps (0 beyond them); the recursion's autograd gave zeros there until wave 35, so a model
    trained on where eager's updates are NaN."""
    from ortrain import ORTModule

    torch.manual_seed(0)
    targets = torch.tensor([[1, 1, 1, 2, 3], [1, 2, 0, 0, 0]])
    lengths = (torch.tensor([4, 6]), torch.tensor([5, 2]))  # the first needs 7 steps, has 4
    scores = torch.randn(6, 2, 5)

    def loss(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x = scores.clone().requires_grad_()
        value = model(x, targets, *lengths)
        return value.detach(), torch.autograd.grad(value.sum(), [x])[0]

    model = _Aligner(reduction)
    (expected, expected_grad), (got, got_grad) = loss(model), loss(ORTModule(model))
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert expected_grad[:4, 0].isnan().all() and not expected_grad[4:, 0].isnan().any()
    torch.testing.assert_close(got_grad, expected_grad, equal_nan=True)


def _loss_and_gradient(model: nn.Module, scores: torch.Tensor, *args: object) -> tuple[torch.Tensor, ...]:
    x = scores.clone().requires_grad_()
    value = model(x, *args)
    return value.detach(), torch.autograd.grad(value.sum(), [x])[0]


def test_a_sample_without_steps_is_eagers_zero_or_infinite_loss() -> None:
    """Wave 48's review: a sample of input length 0 read the first step's column, a finite loss
    (1.17 where eager's is 0 for an empty target, 2.50 where it is inf) and gradients on a step
    it does not have."""
    from ortrain import ORTModule

    torch.manual_seed(0)
    model = _Aligner("none").double()
    targets = torch.tensor([[1, 2, 3], [4, 1, 0], [2, 0, 0]])
    scores = torch.randn(5, 3, 5, dtype=torch.float64)
    wrapped = ORTModule(model)
    for target_lengths in ([3, 0, 1], [3, 1, 1]):
        lengths = (torch.tensor([5, 0, 3]), torch.tensor(target_lengths))
        expected, expected_grad = _loss_and_gradient(model, scores, targets, *lengths)
        got, got_grad = _loss_and_gradient(wrapped, scores, targets, *lengths)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_an_input_length_past_the_time_steps_raises_eagers_error() -> None:
    from ortrain import ORTModule

    model = _Aligner("mean")
    targets = torch.tensor([[1, 2], [3, 0]])
    wrapped = ORTModule(model)
    scores = torch.randn(4, 2, 5)
    wrapped(scores, targets, torch.tensor([4, 3]), torch.tensor([2, 1])).backward()
    with pytest.raises(RuntimeError, match="Expected input_lengths to have value at most 4"):
        wrapped(scores, targets, torch.tensor([4, 5]), torch.tensor([2, 1]))


def test_the_length_check_alone_in_pytorch_gives_no_openmp_advice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The advice to start Python with OMP_WAIT_POLICY=PASSIVE is for PyTorch kernels between ONNX
    Runtime regions; a check of the input lengths runs none."""
    from ortrain import ORTModule
    from ortrain.runtime import graph_executor

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    graph_executor._advise_passive_openmp.cache_clear()  # given once per process
    wrapped = ORTModule(_Aligner("mean"))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        lengths = (torch.tensor([4, 3]), torch.tensor([2, 1]))
        wrapped(torch.randn(4, 2, 5), torch.tensor([[1, 2], [3, 0]]), *lengths)
    assert not [r for r in caplog.records if "OMP_WAIT_POLICY" in r.getMessage()]


def test_under_bfloat16_autocast_the_loss_is_computed_in_float32_as_eagers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Autocast runs ctc_loss in float32; the capture's replacement ran it in bfloat16 (wave 48's
    review: a bfloat16 loss, gradients 5e-3 off)."""
    from ortrain import ORTModule

    # ONNX Runtime's CPU build has no bfloat16 Gemm: the default policy runs it in PyTorch.
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")

    torch.manual_seed(0)
    model = _Aligner("mean")
    wrapped = ORTModule(model)
    targets = torch.tensor([[1, 2, 3], [4, 1, 0], [2, 0, 0]])
    lengths = (torch.tensor([6, 5, 4]), torch.tensor([3, 2, 1]))
    scores = torch.randn(6, 3, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grad = _loss_and_gradient(model, scores, targets, *lengths)
        got, got_grad = _loss_and_gradient(wrapped, scores, targets, *lengths)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grad, expected_grad)
