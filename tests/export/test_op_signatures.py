"""Sharing each ONNX operator's signature changes no exported graph."""

from __future__ import annotations

import contextlib

import onnx
import pytest
import torch
from onnx_ir import schemas

from ortrain import bench
from ortrain.capture.aot_capture import capture
from ortrain.export import fx_to_onnx
from ortrain.export.op_signatures import op_signatures_shared


class _LossOfFlat(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(idx, targets),)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gpt_graphs_are_byte_identical(dynamic: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = bench.build_model("gpt", bench.QUICK)
    captured = capture(
        _LossOfFlat(model), list(batch), training=True, dynamic_dims={0: (1,), 1: (1,)} if dynamic else None
    )
    for gm in (captured.forward.graph, captured.backward.graph):
        shared = fx_to_onnx.export_graph(gm, opset_version=18).model
        monkeypatch.setattr(fx_to_onnx, "op_signatures_shared", contextlib.nullcontext)
        fresh = fx_to_onnx.export_graph(gm, opset_version=18).model
        monkeypatch.undo()
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
