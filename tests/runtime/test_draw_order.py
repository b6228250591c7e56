"""Regions draw random numbers in the captured graph's order (ortrain/runtime/draw_order.py)."""

from __future__ import annotations

import operator

import torch
from torch import nn

from ortrain.capture.aot_capture import capture
from ortrain.capture.python_ops import python_op
from ortrain.runtime.draw_order import draw_epochs, split_by_epoch
from ortrain.runtime.graph_executor import build_graph_executor
from ortrain.runtime.torch_native_ops import is_random

aten = torch.ops.aten


class _EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.decoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            src = nn.functional.dropout(torch.tanh(layer(src)), 0.3)
        for layer in self.decoder:
            tgt = nn.functional.dropout(torch.tanh(layer(tgt)), 0.3)
        return ((src * tgt).sum(-1) ** 2).mean()


def test_regions_draw_in_the_graph_order() -> None:
    """ONNX Runtime's placement: the decoder's dropouts are independent of the encoder's, and the
    fuser merged each into a PyTorch region with an encoder dropout (three regions drew
    encoder 1, then encoder 2 and decoder 1, then encoder 3 and decoder 2)."""
    torch.manual_seed(0)
    captured = capture(_EncoderDecoder(), [torch.randn(4, 8), torch.randn(4, 8)], training=True)
    graph = captured.forward.graph
    draws = [n.name for n in graph.graph.nodes if n.op == "call_function" and is_random(n)]
    assert len(draws) == 5
    runner = build_graph_executor(
        graph, name="forward", opset_version=18, passes=[], saver=None, device=torch.device("cpu")
    )
    per_step = [[n.name for n in step.nodes if n.name in draws] for step in runner.plan.steps]
    assert [name for names in per_step for name in names] == draws
    assert all(len(names) <= 1 for names in per_step)


def _graph(*targets: object) -> torch.fx.Graph:
    """A chain x -> op -> op ... with the given targets (unary, or dropout-like)."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    for target in targets:
        if target is aten.native_dropout.default:
            pair = graph.call_function(target, (value, 0.5, True))
            value = graph.call_function(operator.getitem, (pair, 0))
        else:
            value = graph.call_function(target, (value,))
    graph.output(value)
    return graph


_TWO_DRAWS = (aten.tanh.default, aten.native_dropout.default, aten.relu.default, aten.native_dropout.default)


def test_epochs_start_at_each_drawing_node() -> None:
    graph = _graph(*_TWO_DRAWS)
    epochs = draw_epochs(graph)
    assert epochs is not None
    # x, tanh, dropout, getitem, relu, dropout, getitem, output
    assert [epochs[n.name] for n in graph.nodes] == [0, 0, 1, 1, 1, 2, 2, 2]
    # One drawing node has nothing to be ordered against.
    assert draw_epochs(_graph(aten.tanh.default, aten.native_dropout.default)) is None
    # An opaque autograd Function's Python may draw: it is ordered like a random operator.
    assert draw_epochs(_graph(python_op, aten.native_dropout.default)) is not None


def test_a_group_is_cut_by_epoch_and_getitems_stay_with_their_source() -> None:
    graph = _graph(*_TWO_DRAWS)
    epochs = draw_epochs(graph)
    assert epochs is not None
    compute = {n for n in graph.nodes if n.op == "call_function"}
    parts = split_by_epoch([compute], epochs)
    assert [epoch for epoch, _ in parts] == [0, 1, 2]
    _, tanh, drop, get, relu, drop_1, get_1, _ = graph.nodes
    assert [part for _, part in parts] == [{tanh}, {drop, get, relu}, {drop_1, get_1}]
