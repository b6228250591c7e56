"""Trying each rewrite rule only on its root operator changes no exported graph."""

from __future__ import annotations

import contextlib
import copy

import onnx_ir as ir
import pytest
import torch
from onnxscript import optimizer, rewriter

from ortrain.capture.aot_capture import Capture
from ortrain.export import fx_to_onnx
from ortrain.export.rewrite_rules_by_root import rewrite_rules_tried_by_root_operator


def test_gpt_graphs_are_byte_identical(quick_gpt_capture: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    for gm in (quick_gpt_capture.forward.graph, quick_gpt_capture.backward.graph):
        filtered = fx_to_onnx.export_graph(gm, opset_version=18).model
        with monkeypatch.context() as patch:
            patch.setattr(fx_to_onnx, "rewrite_rules_tried_by_root_operator", contextlib.nullcontext)
            plain = fx_to_onnx.export_graph(gm, opset_version=18).model
        assert filtered.SerializeToString() == plain.SerializeToString()


_INT64 = ir.DataType.INT64


def _two_slices_of_one_tensor() -> ir.Model:
    """``SlicesSplit`` (a rule with two output nodes) rewrites these two halves of the last axis into
    one Split."""
    x = ir.Value(name="x", shape=ir.Shape([4, 6]), type=ir.TensorType(ir.DataType.FLOAT))
    nodes, outputs = [], []
    # The rule pairs a Slice with the first Slice in the graph: the second half comes first.
    for i, (start, end) in enumerate([(3, 6), (0, 3)]):
        consts = [ir.node("Constant", [], {"value": ir.tensor([v], dtype=_INT64)}) for v in (start, end, -1)]
        nodes += consts
        sliced = ir.node("Slice", [x, *(c.outputs[0] for c in consts)], name=f"slice{i}")
        nodes.append(sliced)
        outputs.append(sliced.outputs[0])
    total = ir.node("Add", outputs, name="add")
    total.outputs[0].name = "y"
    graph = ir.Graph([x], total.outputs, nodes=[*nodes, total], opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=10)


def test_a_multi_output_rule_still_fires_and_is_filtered() -> None:
    with rewrite_rules_tried_by_root_operator():
        rules = rewriter._DEFAULT_REWRITE_RULES
        model = _two_slices_of_one_tensor()
        optimizer.optimize_ir(model)
    assert rewriter._DEFAULT_REWRITE_RULES is not rules  # restored
    assert any(r.name == "SlicesSplit" and "try_rewrite" in vars(r) for r in rules)  # filtered
    assert [n.op_type for n in model.graph if n.op_type != "Constant"] == ["Split", "Add"]
    reference = _two_slices_of_one_tensor()
    optimizer.optimize_ir(reference)
    assert ir.serde.serialize_model(model) == ir.serde.serialize_model(reference)


def test_a_rule_is_not_matched_on_other_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    with rewrite_rules_tried_by_root_operator():
        rules = rewriter._DEFAULT_REWRITE_RULES
    split = next(r for r in rules if r.name == "SlicesSplit")
    model = _two_slices_of_one_tensor()
    add = next(n for n in model.graph if n.op_type == "Add")
    first_slice = next(n for n in model.graph if n.op_type == "Slice")

    def no_match(*args: object, **kwargs: object) -> None:
        raise AssertionError("the matcher ran on a node of another operator")

    monkeypatch.setattr(split._matcher, "match", no_match)
    assert split.try_rewrite(model, model.graph, add) is None
    with pytest.raises(AssertionError, match="another operator"):  # a Slice does reach the matcher
        split.try_rewrite(model, model.graph, first_slice)


def test_no_rule_keeps_the_last_graph_it_matched_in() -> None:
    """onnxscript's matchers kept their last match (graph, node, bindings); the default rules live
    as long as the process, so every export's last graph, constants and all, did too (wave 41)."""
    import gc
    import weakref

    with rewrite_rules_tried_by_root_operator():
        rules = rewriter._DEFAULT_REWRITE_RULES
        model = _two_slices_of_one_tensor()
        optimizer.optimize_ir(model)
    graph = weakref.ref(model.graph)
    del model
    gc.collect()
    assert graph() is None
    assert all(getattr(getattr(r, "_matcher", None), "_graph", None) is None for r in rules)


class _BinaryWeights(torch.nn.Module):
    """A binary network's straight-through weights: the weight clamped twice to the same bounds."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clipped = torch.clamp(self.w, -1, 1)
        binary = clipped + (torch.sign(self.w) - torch.clamp(self.w, -2, 2)).detach()
        return (x @ binary.t()).pow(2).mean()


def test_a_tensor_clamped_twice_runs_in_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxscript's Min/Max-to-Clip fusions named both pairs of bounds "<input>_min"/"_max" and left
    the renamed second pair out of the graph: ONNX Runtime refused it (wave 48's review)."""
    from ortrain import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _BinaryWeights()
    model = copy.deepcopy(eager)
    x = torch.randn(5, 3)
    ORTModule(model)(x).backward()
    eager(x).backward()
    torch.testing.assert_close(model.w.grad, eager.w.grad)
