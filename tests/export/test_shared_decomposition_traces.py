"""Nodes alike share one traced decomposition, and the exported graphs stay the same."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.capture.aot_capture import Capture
from ortrain.export import direct_translation, fx_to_onnx
from ortrain.export.exporter_decompositions import onnx_decomposition_table
from ortrain.export.onnx_translations import torchlib_registry

aten = torch.ops.aten


def test_gpt_backward_is_byte_identical(quick_gpt_capture: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    captured = quick_gpt_capture
    traced: list[object] = []
    trace = direct_translation._DecompositionCall.trace
    monkeypatch.setattr(
        direct_translation._DecompositionCall,
        "trace",
        lambda self, table: traced.append(1) or trace(self, table),
    )
    shared = fx_to_onnx.export_graph(captured.backward.graph, opset_version=18).model
    shared_traces = len(traced)
    monkeypatch.setattr(direct_translation, "_reusable", lambda _: False)
    alone = fx_to_onnx.export_graph(captured.backward.graph, opset_version=18).model
    assert shared.SerializeToString() == alone.SerializeToString()
    assert shared_traces < len(traced) - shared_traces  # some nodes did share


def _decomposed(
    fn: object, *args: torch.Tensor, share: bool, monkeypatch: pytest.MonkeyPatch
) -> torch.fx.GraphModule:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    translated, table = onnx_decomposition_table(torchlib_registry(18))
    with monkeypatch.context() as patch:
        if not share:
            patch.setattr(direct_translation, "_reusable", lambda _: False)
        direct_translation._decompose_untranslated(gm, translated, lambda: table)
    return gm


def test_an_input_passed_twice_gets_its_own_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    def fn(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return aten.gelu_backward(g, x), aten.gelu_backward(x, x), aten.gelu_backward(g, g)

    g, x = torch.randn(3, 5), torch.randn(3, 5)
    shared = _decomposed(fn, g, x, share=True, monkeypatch=monkeypatch)
    alone = _decomposed(fn, g, x, share=False, monkeypatch=monkeypatch)
    assert shared.code == alone.code
    assert not any(n.target is aten.gelu_backward.default for n in shared.graph.nodes)
    for got, want in zip(shared(g, x), fn(g, x), strict=True):
        torch.testing.assert_close(got, want)


def test_different_layouts_get_their_own_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    def fn(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return aten.gelu_backward(g, x), aten.gelu_backward(g.t(), x.t())

    g, x = torch.randn(4, 4), torch.randn(4, 4)
    shared = _decomposed(fn, g, x, share=True, monkeypatch=monkeypatch)
    alone = _decomposed(fn, g, x, share=False, monkeypatch=monkeypatch)
    assert shared.code == alone.code
    for got, want in zip(shared(g, x), fn(g, x), strict=True):
        torch.testing.assert_close(got, want)
