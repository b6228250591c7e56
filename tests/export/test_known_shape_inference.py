"""Constant folding without shape inference of nodes whose outputs are known changes no graph."""

from __future__ import annotations

import contextlib

import pytest
from onnxscript.optimizer import _constant_folding

from ortrain.capture.aot_capture import Capture
from ortrain.export import fx_to_onnx
from ortrain.export.known_shape_inference import shape_inference_only_where_unknown


def test_gpt_graphs_are_byte_identical(quick_gpt_capture: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    inferred = []
    original = _constant_folding.FoldConstantsPass._do_inference

    def counted(self: object, node: object) -> None:
        inferred.append(node)
        original(self, node)

    monkeypatch.setattr(_constant_folding.FoldConstantsPass, "_do_inference", counted)
    for gm in (quick_gpt_capture.forward.graph, quick_gpt_capture.backward.graph):
        inferred.clear()
        skipping = fx_to_onnx.export_graph(gm, opset_version=18).model
        skipping_count = len(inferred)
        inferred.clear()
        with monkeypatch.context() as patch:
            patch.setattr(fx_to_onnx, "shape_inference_only_where_unknown", contextlib.nullcontext)
            every_node = fx_to_onnx.export_graph(gm, opset_version=18).model
        assert skipping.SerializeToString() == every_node.SerializeToString()
        assert skipping_count < len(inferred)  # nodes were skipped, and some still inferred
        assert skipping_count > 0


def test_the_pass_is_restored() -> None:
    with shape_inference_only_where_unknown():
        assert _constant_folding.FoldConstantsPass.__name__ == "_FoldConstantsWhereUnknown"
    assert _constant_folding.FoldConstantsPass.__name__ == "FoldConstantsPass"
