"""Type promotion reading recorded values inserts what torch.onnx's own pass inserts."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch.onnx._internal.exporter import _fx_passes

from ortrain import bench
from ortrain.capture.aot_capture import capture
from ortrain.export.recorded_type_promotion import insert_type_promotion_nodes


class _Promoting(torch.nn.Module):
    """Float with integer tensors and scalars, comparisons, true and floor divisions, bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor]:
        y = self.linear(x) * counts
        z = y / (counts + 1) + torch.where(counts > 2, y, 0.5) + counts // 2
        half = (self.linear(x).to(torch.bfloat16) * 3).float()
        return ((z + half).sum() / counts.sum(),)


def _graphs(name: str, flat_call: Callable[[torch.nn.Module], torch.nn.Module]) -> list[torch.fx.GraphModule]:
    if name == "promoting":
        module: torch.nn.Module = _Promoting()
        args = [torch.randn(3, 4), torch.randint(0, 5, (3, 4))]
        dynamic = None
    else:
        model, batch = bench.build_model(name.removesuffix("-dynamic"), bench.QUICK)
        module, args = flat_call(model), list(batch)
        dynamic = {0: (1,), 1: (1,)} if name.endswith("-dynamic") else None
    captured = capture(module, args, training=True, dynamic_dims=dynamic)
    return [captured.forward.graph, captured.backward.graph]


def _described(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(str(s) for s in value.shape))
    if isinstance(value, (list, tuple)):
        return [_described(v) for v in value]
    return str(value)


@pytest.mark.parametrize("name", ["promoting", "gpt", "gpt-dynamic", "sft"])
def test_same_casts_and_values_as_torch_onnx(
    name: str, flat_call: Callable[[torch.nn.Module], torch.nn.Module]
) -> None:
    inserted = 0
    for graph in _graphs(name, flat_call):
        theirs, ours = copy.deepcopy(graph), copy.deepcopy(graph)
        _fx_passes.insert_type_promotion_nodes(theirs)
        insert_type_promotion_nodes(ours)
        assert ours.code == theirs.code
        pairs = list(zip(ours.graph.nodes, theirs.graph.nodes, strict=True))
        for a, b in pairs:
            assert _described(a.meta.get("val")) == _described(b.meta.get("val")), a.name
        casts = torch.ops.prims.convert_element_type.default, torch.ops.aten.scalar_tensor.default
        inserted += sum(n.target in casts for n in ours.graph.nodes) - sum(
            n.target in casts for n in graph.graph.nodes
        )
    if name == "promoting":
        assert inserted >= 4  # the pass had work to do
