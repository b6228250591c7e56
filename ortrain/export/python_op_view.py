"""One ONNX model showing a partitioned graph whole: its ONNX segments joined by PythonOp nodes
(opaque Functions) and TorchRegion nodes (regions that run in PyTorch).

Execution runs each segment in its own session (see ``ortrain.runtime.graph_executor``); this
view is what ``DebugOptions(save_onnx=True)`` writes, so that a reader sees, as with upstream,
one ``PythonOp`` node (domain ``com.microsoft``) per Function call in the forward graph and one
``PythonOpGrad`` node in the backward graph, each with a ``func_name`` attribute holding the
Function's fully qualified name. The view is for reading, not for running.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx.compose
import torch

from ortrain.export.element_types import ONNX_ELEMENT_TYPES
from ortrain.export.fx_to_onnx import ExportedGraph

PYTHON_OP_DOMAIN = "com.microsoft"


@dataclass
class ViewSegment:
    model: onnx.ModelProto
    exported: ExportedGraph
    inputs: list[int]  # slot per FX placeholder of the segment
    outputs: list[int]  # slot per FX output of the segment


@dataclass
class PythonOpNode:
    name: str
    func_name: str
    is_grad: bool
    inputs: list[int]  # slots read
    outputs: dict[int, int]  # result index -> slot


@dataclass
class TorchRegionNode:
    """A region run by the torch executor; ``operators`` lists its ATen operators in order."""

    name: str
    operators: list[str]
    inputs: list[int]  # slots read
    outputs: dict[int, int]  # result index -> slot


TORCH_REGION_DOMAIN = "org.pytorch"


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename(attribute.g, mapping)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _rename(sub, mapping)
    for value in graph.value_info:
        value.name = mapping.get(value.name, value.name)


def _value_info(name: str, value: object) -> onnx.ValueInfoProto | None:
    if not isinstance(value, torch.Tensor) or value.dtype not in ONNX_ELEMENT_TYPES:
        return None
    shape = [int(s) if isinstance(s, int) else str(s) for s in value.shape]
    return onnx.helper.make_tensor_value_info(name, ONNX_ELEMENT_TYPES[value.dtype], shape)


def python_op_view(
    steps: list[ViewSegment | PythonOpNode | TorchRegionNode],
    *,
    input_names: list[str],
    outputs: list[int],
    values: dict[int, object],
    opset_version: int,
) -> onnx.ModelProto:
    """``input_names``: the graph inputs (slot ``i`` is input ``i``); ``outputs``: the slots the
    graph returns; ``values``: the fake value of each slot, for types and shapes."""
    names: dict[int, str] = {}  # slot -> ONNX value name, for slots that hold tensors
    graph = onnx.helper.make_graph([], "ortrain_python_op_view", [], [])
    for slot, name in enumerate(input_names):
        info = _value_info(name, values.get(slot))
        if info is not None:
            names[slot] = name
            graph.input.append(info)
    opsets: dict[str, int] = {"": opset_version, PYTHON_OP_DOMAIN: 1}
    ir_version = onnx.IR_VERSION
    for position, step in enumerate(steps):
        if isinstance(step, (PythonOpNode, TorchRegionNode)):
            results = [f"{step.name}_out{i}" for i in range(max(step.outputs, default=-1) + 1)]
            for index, slot in step.outputs.items():
                names[slot] = results[index] = f"v{slot}"
                info = _value_info(names[slot], values.get(slot))
                if info is not None:
                    graph.value_info.append(info)
            if isinstance(step, TorchRegionNode):
                graph.node.append(
                    onnx.helper.make_node(
                        "TorchRegion",
                        [names[s] for s in step.inputs if s in names],
                        results,
                        name=step.name,
                        domain=TORCH_REGION_DOMAIN,
                        operators=step.operators,
                    )
                )
                opsets[TORCH_REGION_DOMAIN] = 1
                continue
            graph.node.append(
                onnx.helper.make_node(
                    "PythonOpGrad" if step.is_grad else "PythonOp",
                    [names[s] for s in step.inputs if s in names],
                    results,
                    name=step.name,
                    domain=PYTHON_OP_DOMAIN,
                    func_name=step.func_name,
                )
            )
            continue
        _add_segment(graph, step, f"seg{position}/", names)
        for opset in step.model.opset_import:
            opsets[opset.domain] = max(opsets.get(opset.domain, 0), opset.version)
        ir_version = min(ir_version, step.model.ir_version) if step.model.ir_version else ir_version
    for slot in dict.fromkeys(s for s in outputs if s in names):
        info = _value_info(names[slot], values.get(slot))
        if info is not None:
            graph.output.append(info)
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    )
    model.ir_version = ir_version
    for step in steps:
        if isinstance(step, ViewSegment):
            model.functions.extend(step.model.functions)
    return model


def _add_segment(graph: onnx.GraphProto, step: ViewSegment, prefix: str, names: dict[int, str]) -> None:
    model = onnx.compose.add_prefix(step.model, prefix)
    mapping: dict[str, str] = {}
    for onnx_input, position in zip(model.graph.input, step.exported.input_positions, strict=True):
        slot = step.inputs[position]
        if slot not in names:
            # Made in PyTorch between two sessions (a view of a region's output, say): the view
            # shows it as an input of its own.
            names[slot] = f"v{slot}"
            declared = onnx.ValueInfoProto()
            declared.CopyFrom(onnx_input)
            declared.name = names[slot]
            graph.input.append(declared)
        mapping[onnx_input.name] = names[slot]
    onnx_outputs = [o.name for o in model.graph.output]
    for source, slot in zip(step.exported.outputs, step.outputs, strict=True):
        if source.kind == "onnx":
            names[slot] = f"v{slot}"
            mapping[onnx_outputs[source.index]] = names[slot]
        elif source.kind == "input" and step.inputs[source.index] in names:
            names[slot] = names[step.inputs[source.index]]
        elif source.kind == "same" and step.outputs[source.index] in names:
            names[slot] = names[step.outputs[source.index]]
    _rename(model.graph, mapping)
    graph.node.extend(model.graph.node)
    graph.initializer.extend(model.graph.initializer)
    graph.value_info.extend(model.graph.value_info)
