"""nn.LSTM / nn.GRU / nn.RNN train on ONNX Runtime, unrolled while capturing."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_same_state, runs_whole_in_onnxruntime, train_side_by_side
from torch import nn


class _Tagger(nn.Module):
    def __init__(self, kind: type[nn.RNNBase], **options: object) -> None:
        super().__init__()
        self.rnn = kind(6, 8, batch_first=True, **options)
        width = 16 if options.get("bidirectional") else 8
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x)[0]
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    ("kind", "options"),
    [(nn.LSTM, {"num_layers": 2, "bidirectional": True}), (nn.GRU, {}), (nn.RNN, {"nonlinearity": "relu"})],
    ids=["lstm-2-layers-bidirectional", "gru", "rnn-relu"],
)
def test_recurrent_layers_train_like_eager_in_onnxruntime(kind: type[nn.RNNBase], options: dict) -> None:
    """On the CPU they ran as oneDNN's mkldnn_rnn_layer: no ONNX translation, and between ONNX
    Runtime regions an undefined workspace AOTAutograd refused; worse, the flat weights the layer
    rebuilds when a capture swaps its parameters looked like a model that changes at every call,
    which sent it to TorchDynamo and so, whole, to eager PyTorch."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, 5, 6), torch.randint(0, 3, (2, 5))) for _ in range(3)]
    model = _Tagger(kind, **options)
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, b: m(*b))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert wrapped._ortrain_graph_breaks is None
    runners = [runner for _, runner in wrapped.graph_runners()]
    assert len(runners) == 2 and all(runs_whole_in_onnxruntime(r) for r in runners)


def test_a_new_sequence_length_after_the_dynamic_capture_captures_again() -> None:
    """Unrolling loops over the sequence, which pins the length traced with symbolic sizes to the
    one it was traced at (a guard AOTAutograd keeps as a replaced symbol, not as an expression):
    the graph was taken for any length, and the third length failed in ONNX Runtime ("cannot be
    reshaped", 2 × 5 rows baked in)."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, n, 6), torch.randint(0, 3, (2, n))) for n in (4, 5, 7, 5)]
    model = _Tagger(nn.GRU)
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, b: m(*b))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    sizes = sorted(entry.sizes[0] for entries in wrapped._ortrain_graphs.values() for entry in entries)
    assert sizes == [(2, 4, 6), (2, 5, 6), (2, 7, 6)]  # one graph a length; 5 again reuses its own
