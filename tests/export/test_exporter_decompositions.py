"""torch.onnx's decomposition re-trace is skipped only for programs it would not change, and the
exported model is then the same."""

from __future__ import annotations

import contextlib
import operator

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ortrain.capture.aot_capture import capture
from ortrain.export.exporter_decompositions import needs_no_decomposition
from ortrain.export.fx_to_onnx import export_graph
from ortrain.export.onnx_translations import torchlib_registry

aten = torch.ops.aten


def _graph(*targets: object) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    value = x
    for target in targets:
        value = graph.call_function(target, (value, value) if target is not aten.relu.default else (value,))
    graph.output((value,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.fixture(scope="module")
def translated() -> set[object]:
    from torch.onnx._internal.exporter import _decomp

    return set(_decomp.get_onnx_implemented_overloads(torchlib_registry()))


def test_only_translated_functional_operators_skip(translated: set[object]) -> None:
    assert needs_no_decomposition(_graph(aten.mm.default, aten.relu.default, operator.mul), translated)
    assert not needs_no_decomposition(_graph(aten.mm.default, aten.gelu_backward.default), translated)
    assert not needs_no_decomposition(_graph(aten.add_.Tensor), translated)  # mutates
    assert not needs_no_decomposition(_graph(torch.add), translated)  # not an ATen operator


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.relu(self.linear(x)).sum(),)


def _run(model: object, args: list[np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: a for i, a in zip(session.get_inputs(), args, strict=True)})


def test_skipped_export_is_the_same_model(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    forward = capture(_Net(), [torch.randn(3, 5)], training=True).forward.graph
    retraced: list[object] = []
    original = torch.export.ExportedProgram.run_decompositions

    def counting(self: torch.export.ExportedProgram, *args: object, **kwargs: object) -> object:
        retraced.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counting)
    # This file is about torch.onnx.export's path; test_direct_translation.py covers the other.
    monkeypatch.setattr("ortrain.export.fx_to_onnx.DIRECT_TRANSLATION", False)
    lean = export_graph(forward, opset_version=18)
    assert retraced == []  # addmm, relu, sum, ...: nothing to decompose, not re-traced
    monkeypatch.setattr("ortrain.export.fx_to_onnx.lean_decomposition", contextlib.nullcontext)
    full = export_graph(forward, opset_version=18)
    assert len(retraced) == 1  # torch.onnx's own path re-traces
    assert [n.op_type for n in lean.model.graph.node] == [n.op_type for n in full.model.graph.node]
    assert lean.input_positions == full.input_positions and lean.outputs == full.outputs
    rng = np.random.default_rng(0)
    args = [
        rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in full.model.graph.input
    ]
    for got, want in zip(_run(lean.model, args), _run(full.model, args), strict=True):
        np.testing.assert_array_equal(got, want)
