"""The exporter's op registry is made once per opset and each export gets its own copy."""

from __future__ import annotations

import pytest
from torch.onnx._internal.exporter import _registration

from ortrain.export import lazy_op_registry, onnx_translations


def test_registry_made_once_per_opset_and_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_translations, "_OP_REGISTRIES", {})
    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    made: list[int] = []

    class Counting(lazy_op_registry.LazyTorchlibRegistry):
        def __init__(self, opset_version: int) -> None:
            made.append(opset_version)
            super().__init__(opset_version)

    monkeypatch.setattr(lazy_op_registry, "LazyTorchlibRegistry", Counting)
    with onnx_translations.reused_op_registry():
        first = _registration.ONNXRegistry().from_torchlib(opset_version=18)
        second = _registration.ONNXRegistry.from_torchlib(opset_version=18)
        assert made == [18]
        assert first is not second and first.functions == second.functions and first.opset_version == 18
        assert type(first.functions) is dict  # a plain copy: torch.onnx.export may edit its own
        target = next(iter(first.functions))
        first.functions[target].clear()  # a caller registering its own ops changes no other registry
        first.functions.pop(target)
        assert second.functions[target] and target in _registration.ONNXRegistry.from_torchlib(18).functions
        _registration.ONNXRegistry.from_torchlib(opset_version=19)
        assert made == [18, 19]
        assert onnx_translations.torchlib_registry(18) is onnx_translations.torchlib_registry(18)
        assert made == [18, 19]  # the partitioner's look-ups share the exports' registry
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original  # restored
