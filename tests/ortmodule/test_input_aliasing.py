"""A graph captured for the same tensor passed twice is not reused for distinct tensors, nor the
reverse: AOTAutograd captures one input for the two, a different function of the inputs."""

from __future__ import annotations

import copy
import logging

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


def test_writing_into_a_view_of_a_leaf_is_refused_as_in_eager_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wave 49's review: the graph ran and failed, and the default policy then trained the model
    in PyTorch for good over the user's own mistake."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    torch.manual_seed(0)
    model = _AddsInPlace()
    wrapped = ORTModule(copy.deepcopy(model))
    wrapped(torch.randn(3, 4), torch.randn(3, 4))
    leaf = torch.zeros(5, 4, requires_grad=True)
    for module in (model, wrapped):
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            module(leaf[1:4], torch.randn(3, 4))
    assert not leaf.any()
    wrapped(torch.randn(3, 4), torch.randn(3, 4))
    assert not wrapped._ortrain_fallback.active


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


class _MasksItsLabels(torch.nn.Module):
    """A language model given windows of one token stream, masking padding in its labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(12, 8)
        self.head = torch.nn.Linear(8, 12)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels.masked_fill_(labels == 0, -100)
        logits = self.head(self.embedding(ids.clamp(min=0)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_windows_of_one_stream_written_by_the_forward_are_read_where_they_lie(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """AOTAutograd remakes written inputs that share memory from one base with the layouts of the
    capture: until wave 43 the windows at other offsets ran on the first window's memory (window
    0's loss at every step, silently)."""
    torch.manual_seed(0)
    model = _MasksItsLabels()
    wrapped = ORTModule(copy.deepcopy(model))
    stream = torch.randint(0, 12, (2, 30))
    streams = [stream, stream.clone()]
    for start in (0, 7, 14, 0):
        losses: list[torch.Tensor] = []
        for m, stream in zip((model, wrapped), streams, strict=True):
            with caplog.at_level(logging.INFO, logger="ortrain"):
                loss = m(stream[:, start : start + 6], stream[:, start + 1 : start + 7])
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
        assert torch.equal(streams[1], streams[0])
        torch.testing.assert_close(wrapped.head.weight.grad, model.head.weight.grad)
    # Windows 7 and 14 captured (the last window 0 found its graph), saying why.
    assert caplog.text.count("capturing a graph: inputs that share memory and that the forward writes") == 2


def test_windows_of_one_stream_the_forward_only_reads_share_one_graph() -> None:
    class ReadsItsLabels(_MasksItsLabels):
        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = self.head(self.embedding(ids))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    model = ReadsItsLabels()
    wrapped = ORTModule(copy.deepcopy(model))
    stream = torch.randint(0, 12, (2, 40))
    for start in (0, 7, 14):
        window = (stream[:, start : start + 6], stream[:, start + 1 : start + 7])
        torch.testing.assert_close(wrapped(*window), model(*window))
    assert sum(len(entries) for entries in wrapped._ortrain_graphs.values()) == 1


class _UpdatesItsMemory(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("memory", torch.randn(6, 4))

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        self.memory.add_(1.0)
        return (self.linear(x) * slot.sum()).square().mean()


def test_an_input_that_is_a_row_of_a_buffer_the_forward_writes_is_read_where_it_lies() -> None:
    """``model(x, model.memory[r])``: the graph captured for row 0 read row 0 for every row until
    wave 43 (the input's sharing with the model's buffer was not in the graph's key)."""
    torch.manual_seed(0)
    model = _UpdatesItsMemory()
    wrapped = ORTModule(copy.deepcopy(model))
    for row in (0, 0, 2, 3):
        x = torch.randn(3, 4)
        losses = [m(x, m.memory[row]) for m in (model, wrapped)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0])
        torch.testing.assert_close(wrapped.linear.weight.grad, model.linear.weight.grad)
        torch.testing.assert_close(wrapped.memory, model.memory)


def test_a_graph_for_one_tensor_twice_does_not_run_a_view_of_it_when_written() -> None:
    """``m(a, a)`` then ``m(a, a.view(8, 4))``: AOTAutograd's graph assumes input 1 is input 0
    (until wave 43: its assertion sent the user to PyTorch's tracker, and the model fell back)."""
    torch.manual_seed(0)
    model = _AddsInPlace()
    wrapped = ORTModule(copy.deepcopy(model))
    for second in (lambda a: a, lambda a: a.view(8, 4), lambda a: a):
        tensors = [torch.randn(8, 4) for _ in range(2)]
        tensors[1].copy_(tensors[0])
        outputs = [m(a, second(a)) for m, a in zip((model, wrapped), tensors, strict=True)]
        torch.testing.assert_close(outputs[1], outputs[0])
        torch.testing.assert_close(tensors[1], tensors[0])


class _ClampsItsPerturbation(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            delta.clamp_(-0.5, 0.5)  # the projection step of an adversarial perturbation
        return self.fc(x + delta).square().mean()


def test_a_leaf_written_under_no_grad_inside_the_forward_trains_as_in_eager() -> None:
    """The regression review: eager allows the write under ``no_grad``, which was refused."""
    torch.manual_seed(0)
    eager = _ClampsItsPerturbation()
    wrapped = ORTModule(copy.deepcopy(eager))
    x, start = torch.randn(3, 4), torch.randn(3, 4)
    deltas = []
    for module in (eager, wrapped):
        delta = start.clone().requires_grad_()
        module(x, delta).backward()
        deltas.append(delta)
    torch.testing.assert_close(deltas[1], deltas[0])
    torch.testing.assert_close(deltas[1].grad, deltas[0].grad)
    torch.testing.assert_close(wrapped.fc.weight.grad, eager.fc.weight.grad)
