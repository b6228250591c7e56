"""The partitioner on its own: where each node of a graph with python ops runs."""

from __future__ import annotations

import torch
from torch import nn

from ortrain.capture.aot_capture import capture
from ortrain.runtime.partitioner import OnnxSegment, PythonOpStep, partition


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        h = _Double.apply(self.first(x))
        return (self.second(self.norm(h)).sum(),)


def _plan():
    captured = capture(_Net(), [torch.randn(4, 8)], training=True)
    return captured, partition(captured.forward.graph)


def test_one_python_op_splits_the_forward_into_two_segments() -> None:
    _, plan = _plan()
    kinds = [type(step) for step in plan.steps]
    assert kinds == [OnnxSegment, PythonOpStep, OnnxSegment]


def test_work_on_graph_inputs_alone_runs_beside_its_reader() -> None:
    # The second Linear's weight transpose depends on a parameter only; it belongs with the
    # matmul after the python op, not in the first segment (where it would cross as a copy).
    _, plan = _plan()
    first, _, last = plan.steps
    first_targets = {n.target for n in first.graph.graph.nodes}
    last_targets = {n.target for n in last.graph.graph.nodes}
    assert torch.ops.aten.t.default in last_targets
    assert sum(n.target is torch.ops.aten.t.default for n in first.graph.graph.nodes) == 1
    assert torch.ops.aten.native_layer_norm.default in last_targets
    assert torch.ops.aten.native_layer_norm.default not in first_targets


def test_a_multi_output_op_and_its_getitems_share_a_segment() -> None:
    _, plan = _plan()
    for step in plan.steps:
        if not isinstance(step, OnnxSegment):
            continue
        for node in step.graph.graph.nodes:
            if node.op == "placeholder":
                assert not isinstance(node.meta.get("val"), tuple), node.name
