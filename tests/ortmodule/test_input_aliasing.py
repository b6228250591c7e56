"""A graph captured for the same tensor passed twice is not reused for distinct tensors, nor the
reverse: AOTAutograd captures one input for the two, a different function of the inputs."""

from __future__ import annotations

import copy

import pytest
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


class _AddsInPlace(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return self.linear(a) + b * 2


def test_the_same_tensor_twice_mutated_in_forward_runs_every_step() -> None:
    """AOTAutograd turns two aliasing inputs that the forward mutates into one base input: the
    graph had fewer inputs than the call, and the second step raised in the size bookkeeping."""
    torch.manual_seed(0)
    eager = _AddsInPlace()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step in range(4):
        x = torch.randn(3 + step % 2, 4)  # a new size, too: the dynamic capture takes the same path
        x_eager = x.clone()
        torch.testing.assert_close(wrapped(x, x), eager(x_eager, x_eager))
        torch.testing.assert_close(x, x_eager)  # the caller's tensor changed as in eager


def test_writing_into_a_leaf_input_that_requires_grad_is_refused_as_in_eager() -> None:
    """Eager refuses ``x.add_(1)`` on a leaf that requires grad; the captured graph, which writes
    its inputs back after running, changed ``x`` and gave it a gradient without a word."""
    torch.manual_seed(0)
    model = _AddsInPlace()
    wrapped = ORTModule(copy.deepcopy(model))
    wrapped(torch.randn(3, 4), torch.randn(3, 4))  # a plain input: captured, mutated as in eager
    leaf = torch.zeros(3, 4, requires_grad=True)
    for module in (model, wrapped):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            module(leaf, torch.randn(3, 4))
    assert not leaf.any() and leaf.grad is None


def test_writing_into_a_leaf_input_is_refused_by_a_capture_from_the_cache(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stored capture keeps which inputs the forward writes into: loaded from
    ORTMODULE_CACHE_DIR, it had forgotten, and the leaf was changed without a word."""
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = _AddsInPlace()
    for _ in range(2):  # the first wrapper stores the capture, the second loads it
        leaf = torch.zeros(3, 4, requires_grad=True)
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            ORTModule(copy.deepcopy(model))(leaf, torch.randn(3, 4))
        assert not leaf.any() and leaf.grad is None
    assert list(tmp_path.glob("capture-*"))


class _ScalesUnlessTensor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, scale: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return (a + b) * self.weight * (scale if isinstance(scale, float) else 1.0)


def test_a_changing_number_before_aliased_mutated_inputs_takes_effect() -> None:
    """AOTAutograd merges ``x, x`` written in place into one input, so the graph has fewer inputs
    than the call: the check whether the graph reads the lifted ``scale`` looked at the wrong one,
    kept the graph of the tensor branch, and every later ``scale`` was ignored (2 for 6, 10)."""
    eager, wrapped = _ScalesUnlessTensor(), ORTModule(_ScalesUnlessTensor())
    for scale in (2.0, 3.0, 5.0):
        x, x_eager = torch.zeros(4), torch.zeros(4)
        torch.testing.assert_close(wrapped(scale, x, x), eager(scale, x_eager, x_eager))
        torch.testing.assert_close(x, x_eager)
