"""The lazily built op registry holds what torch.onnx's ``from_torchlib`` builds, and builds only
what is looked up."""

from __future__ import annotations

import pytest
from torch.onnx._internal.exporter import _decomp, _registration

from ortrain.capture.aot_capture import Capture
from ortrain.export.lazy_op_registry import LazyTorchlibRegistry


def _entry(meta: _registration.OnnxDecompMeta) -> tuple[object, ...]:
    signature = None if meta.signature is None else str(meta.signature)
    return (
        meta.onnx_function,
        meta.fx_target,
        signature,
        meta.is_custom,
        meta.is_complex,
        meta.opset_introduced,
        meta.device,
        meta.skip_signature_inference,
    )


@pytest.mark.parametrize("opset", [18, 23])
def test_same_operators_and_entries_as_from_torchlib(opset: int) -> None:
    full = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    lazy = LazyTorchlibRegistry(opset)
    assert lazy.opset_version == full.opset_version == opset
    assert set(lazy.implemented_targets()) == set(_decomp.get_onnx_implemented_overloads(full))
    assert not lazy.functions._built  # naming the operators built none of them
    assert list(lazy.functions) == list(full.functions)
    for key, metas in full.functions.items():
        assert [_entry(m) for m in lazy.functions[key]] == [_entry(m) for m in metas], key


def test_gpt_operators_answered_alike_building_only_those(quick_gpt_capture: Capture) -> None:
    targets = {
        node.target
        for graph in (quick_gpt_capture.forward.graph, quick_gpt_capture.backward.graph)
        for node in graph.graph.nodes
        if node.op == "call_function"
    }
    full = _registration.ONNXRegistry.from_torchlib()
    lazy = LazyTorchlibRegistry(full.opset_version)
    for target in targets:
        assert lazy.is_registered(target) == full.is_registered(target), target
        got, want = lazy.get_decomps(target), full.get_decomps(target)
        assert [_entry(m) for m in got] == [_entry(m) for m in want], target
    assert any(full.is_registered(t) for t in targets) and not all(full.is_registered(t) for t in targets)
    assert 0 < len(lazy.functions._built) <= len(targets) < len(full.functions) / 5
