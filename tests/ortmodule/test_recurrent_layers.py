"""nn.LSTM / nn.GRU / nn.RNN: one opaque op run by PyTorch's kernel, or unrolled into ONNX Runtime
when Functions are traced (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0)."""

from __future__ import annotations

import copy

import pytest
import torch
from _parity import assert_same_state, runs_whole_in_onnxruntime, train_side_by_side
from test_custom_autograd_function import python_op_counts
from torch import nn

from ortrain import ORTModule
from ortrain.capture.python_ops import iter_python_op_nodes, lookup_call


class _Tagger(nn.Module):
    def __init__(self, kind: type[nn.RNNBase], **options: object) -> None:
        super().__init__()
        self.rnn = kind(6, 8, batch_first=True, **options)
        width = (options.get("proj_size") or 8) * (2 if options.get("bidirectional") else 1)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x)[0]
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


KINDS = [
    (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
    (nn.LSTM, {"proj_size": 5}),
    (nn.GRU, {}),
    (nn.RNN, {"nonlinearity": "relu"}),
]
KIND_IDS = ["lstm-2-layers-bidirectional", "lstm-projections", "gru", "rnn-relu"]


def _graph_sizes(wrapped) -> list[tuple[int, ...]]:
    return sorted(entry.sizes[0] for entries in wrapped._ortrain_graphs.values() for entry in entries)


def _python_op_names(wrapped) -> list[str]:
    return sorted(
        lookup_call(int(node.args[1])).func_name
        for entries in wrapped._ortrain_graphs.values()
        for entry in entries
        for node in iter_python_op_nodes(entry.capture.forward.graph.graph)
    )


@pytest.mark.parametrize(("kind", "options"), KINDS, ids=KIND_IDS)
def test_recurrent_layers_train_like_eager_as_one_pytorch_op(kind: type[nn.RNNBase], options: dict) -> None:
    """Each layer is one python op running PyTorch's own kernel, the rest in ONNX Runtime. Unrolled
    (until wave 15), a 2-layer LSTM over 64 steps took ≈ 30 s to capture per sequence length and
    its step 2.7× eager's."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, 5, 6), torch.randint(0, 3, (2, 5))) for _ in range(3)]
    model = _Tagger(kind, **options)
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, b: m(*b))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert wrapped._ortrain_graph_breaks is None
    assert python_op_counts(wrapped) == [(1, 1)]
    name = _OP_NAMES[kind, options.get("nonlinearity")]
    assert _python_op_names(wrapped) == [f"ortrain.capture.recurrent_layers.{name}"]


_OP_NAMES = {(nn.LSTM, None): "LSTM", (nn.GRU, None): "GRU", (nn.RNN, "relu"): "RNNReLU"}


def test_one_dynamic_capture_serves_every_sequence_length() -> None:
    """The op states its output shape from its input's, so the graph captured with symbolic sizes
    holds for any length: two captures for five lengths (unrolled, one capture a length)."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, n, 6), torch.randint(0, 3, (2, n))) for n in (4, 5, 7, 9, 3)]
    model = _Tagger(nn.LSTM, num_layers=2)
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, b: m(*b))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert len(wrapped._ortrain_graphs) == 2


class _Seq2Seq(nn.Module):
    """Sequence-first LSTM fed its initial states, returning the final ones too."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 8, num_layers=2, dropout=0.4)
        self.head = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, (h, c) = self.rnn(x, (h0, c0))
        return self.head(out), h, c


def test_initial_states_dropout_between_layers_and_eval() -> None:
    """Dropout between layers draws from PyTorch's generator at run time, as eager does: under the
    same seed, the same masks. Gradients reach the initial states; eval() turns dropout off."""
    torch.manual_seed(0)
    model = _Seq2Seq()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for step, length in enumerate((5, 5, 7)):
        x = torch.randn(length, 3, 6)
        h0 = torch.randn(2, 3, 8, requires_grad=True)
        c0 = torch.randn(2, 3, 8, requires_grad=True)
        results = []
        for module in (wrapped, eager):
            module.zero_grad()
            states = (h0.detach().requires_grad_(), c0.detach().requires_grad_())
            torch.manual_seed(100 + step)
            out, h, c = module(x, *states)
            (out.square().mean() + h.sum() + c.mean()).backward()
            results.append([out, h, c, *(s.grad for s in states), *(p.grad for p in module.parameters())])
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    wrapped.eval()
    eager.eval()
    with torch.no_grad():
        x = torch.randn(4, 3, 6)
        h0, c0 = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8)
        for got, want in zip(wrapped(x, h0, c0), eager(x, h0, c0), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_traced_functions_unroll_into_onnxruntime(monkeypatch) -> None:
    """ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 traces every Function and unrolls recurrent layers: the
    whole graph runs in ONNX Runtime."""
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0")
    torch.manual_seed(0)
    batches = [(torch.randn(2, 5, 6), torch.randint(0, 3, (2, 5))) for _ in range(2)]
    model = _Tagger(nn.LSTM, num_layers=2, bidirectional=True)
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, b: m(*b))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    runners = [runner for _, runner in wrapped.graph_runners()]
    assert len(runners) == 2 and all(runs_whole_in_onnxruntime(r) for r in runners)


def test_unrolled_a_new_sequence_length_after_the_dynamic_capture_captures_again(monkeypatch) -> None:
    """Unrolling loops over the sequence, which pins the length traced with symbolic sizes to the
    one it was traced at (a guard AOTAutograd keeps as a replaced symbol, not as an expression):
    the graph was taken for any length, and the third length failed in ONNX Runtime ("cannot be
    reshaped", 2 × 5 rows baked in)."""
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0")
    torch.manual_seed(0)
    batches = [(torch.randn(2, n, 6), torch.randint(0, 3, (2, n))) for n in (4, 5, 7, 5)]
    model = _Tagger(nn.GRU)
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, b: m(*b))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert _graph_sizes(wrapped) == [(2, 4, 6), (2, 5, 6), (2, 7, 6)]  # one graph a length; 5 reuses its own


class _ReturnsStates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.rnn(x)


@pytest.mark.parametrize("used", ["output", "hidden"])
def test_returned_states_whose_gradients_go_unused(used: str) -> None:
    """The model returns the LSTM's output and states, the loss reads one of them: the backward's
    variant without the unused gradients made their zeros inside the op's region, which the python
    op executor could not read (KeyError 'zeros_default'), for any opaque Function."""
    torch.manual_seed(0)
    model = _ReturnsStates()

    def loss_of(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out, (h, _) = module(x)
        return out.square().mean() if used == "output" else h.sum()

    batches = [torch.randn(2, n, 4) for n in (5, 5, 7)]
    losses, expected, eager, wrapped = train_side_by_side(model, batches, loss_of)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.rnn(x)[0]
        return self.a(out).pow(2).mean(), self.b(out).sin().mean()


@pytest.mark.parametrize("second", ["other loss", "same loss"])
def test_a_backward_that_keeps_the_graph_runs_the_layer_again(second: str) -> None:
    """Multi-task losses with their own backwards (``l1.backward(retain_graph=True); l2.backward()``)
    through a recurrent layer were refused at the second backward (wave 47's review: "retain_graph
    is not supported", with the first backward's gradients already accumulated)."""
    torch.manual_seed(0)
    eager = _TwoHeads().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    for batch in (2, 3):
        x = torch.randn(batch, 5, 4, dtype=torch.float64)
        for module in (eager, wrapped):
            first, other = module(x)
            first.backward(retain_graph=True)
            (other if second == "other loss" else first).backward()
        for name, p in eager.named_parameters():
            torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, msg=name)
    first, _ = wrapped(x)
    first.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        first.backward()


class _RecurrentCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=True, num_layers=2, dropout=0.3)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1]).squeeze(-1)


def test_a_gradient_penalty_through_a_recurrent_layer_is_eagers() -> None:
    """WGAN-GP on a recurrent critic: the recompute under create_graph=True runs the PyTorch layer,
    which differentiates twice (wave 47's review: refused, as if the user had written an opaque
    Function)."""
    torch.manual_seed(0)
    eager = _RecurrentCritic().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step in range(2):
        x = torch.randn(3, 5, 4, dtype=torch.float64)
        losses = []
        for module in (eager, wrapped):
            module.zero_grad()
            inputs = x.clone().requires_grad_()
            torch.manual_seed(step)  # the same dropout masks
            score = module(inputs)
            (grad,) = torch.autograd.grad(score.sum(), inputs, create_graph=True)
            loss = score.mean() + 10 * ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
        for name, p in eager.named_parameters():
            torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, msg=name)
