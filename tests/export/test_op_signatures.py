"""Sharing each ONNX operator's signature changes no exported graph."""

from __future__ import annotations

import contextlib

import onnx
import pytest
from onnx_ir import schemas

from ortrain.capture.aot_capture import Capture
from ortrain.export import fx_to_onnx
from ortrain.export.op_signatures import op_signatures_shared


def test_gpt_graphs_are_byte_identical(quick_gpt_capture: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    for gm in (quick_gpt_capture.forward.graph, quick_gpt_capture.backward.graph):
        shared = fx_to_onnx.export_graph(gm, opset_version=18).model
        with monkeypatch.context() as patch:
            patch.setattr(fx_to_onnx, "op_signatures_shared", contextlib.nullcontext)
            fresh = fx_to_onnx.export_graph(gm, opset_version=18).model
        assert shared.SerializeToString() == fresh.SerializeToString()


def test_one_signature_per_operator_and_version_restored() -> None:
    original = schemas.OpSignature.__dict__["from_op_schema"]
    add, mul = onnx.defs.get_schema("Add", 18), onnx.defs.get_schema("Mul", 18)
    with op_signatures_shared():
        first = schemas.OpSignature.from_op_schema(add)
        assert schemas.OpSignature.from_op_schema(add) is first
        assert schemas.OpSignature.from_op_schema(mul) is not first
    assert schemas.OpSignature.__dict__["from_op_schema"] is original
    assert schemas.OpSignature.from_op_schema(add) == first
