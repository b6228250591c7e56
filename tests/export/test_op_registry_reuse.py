"""The exporter's op registry is built once per opset and each export gets its own copy."""

from __future__ import annotations

import pytest
from torch.onnx._internal.exporter import _registration

from ortrain.export import onnx_translations


def test_registry_built_once_per_opset_and_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_translations, "_OP_REGISTRIES", {})
    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    built: list[int] = []

    def counting(cls: type, opset_version: int = 18) -> object:
        built.append(opset_version)
        return original.__func__(cls, opset_version=opset_version)

    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(counting))
    with onnx_translations.reused_op_registry():
        first = _registration.ONNXRegistry().from_torchlib(opset_version=18)
        second = _registration.ONNXRegistry.from_torchlib(opset_version=18)
        assert built == [18]
        assert first is not second and first.functions == second.functions and first.opset_version == 18
        target = next(iter(first.functions))
        first.functions[target].clear()  # a caller registering its own ops changes no other registry
        first.functions.pop(target)
        assert second.functions[target] and target in _registration.ONNXRegistry.from_torchlib(18).functions
        _registration.ONNXRegistry.from_torchlib(opset_version=19)
        assert built == [18, 19]
        assert onnx_translations.torchlib_registry(18) is onnx_translations.torchlib_registry(18)
        assert built == [18, 19]  # the partitioner's look-ups share the exports' registry
    assert _registration.ONNXRegistry.__dict__["from_torchlib"].__func__ is counting  # restored
