"""What the ONNX passes that rewrite one node at a time share (through ``onnx_ir``).

A pass gives :func:`rewrite_each_node` a function that rewrites one node in place (inserting the
new nodes with :func:`insert_node`, handing the old output over with :func:`take_over_output`)
and says whether it did; the model comes back unchanged, not re-serialized, when nothing matched.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir import convenience


def insert_node(
    graph: ir.Graph,
    before: ir.Node,
    tag: str,
    op_type: str,
    inputs: list[ir.Value],
    step: str,
    domain: str = "",
    **attributes: object,
) -> ir.Value:
    """A new one-output node ``{tag}/{step}`` just before ``before``; returns its output."""
    node = ir.node(op_type, inputs, attributes, domain=domain, name=f"{tag}/{step}", num_outputs=1)  # type: ignore[arg-type]
    graph.insert_before(before, node)
    return node.outputs[0]


def int64_constant(op: Callable[..., ir.Value], step: str, values: list[int]) -> ir.Value:
    """A 1-D int64 ``Constant`` (a shape, axes) through ``op``, an :func:`insert_node` bound to
    its graph, node and tag."""
    return op("Constant", [], step, value=ir.tensor(np.array(values, dtype=np.int64)))


def take_over_output(result: ir.Value, out: ir.Value) -> None:
    """``result`` replaces ``out`` everywhere, graph outputs included, under its type and name."""
    # The type as a whole: an intermediate value without value_info has none, and setting a dtype
    # of None would leave a Tensor(None) type that cannot be serialized.
    result.type, result.shape = out.type, out.shape
    out.replace_all_uses_with(result, replace_graph_outputs=True)
    result.name = out.name  # the exported name: a gradient output keeps its name


def reduced_axes(node: ir.Node) -> list[int] | None:
    """The axes a reduction node (opset 18's ``axes`` input, a constant) reduces, each in
    ``[0, rank)``, sorted; None where they are not known (no axes input, a computed one, an input
    of unknown rank or rank 0)."""
    data = node.inputs[0] if node.inputs else None
    axes = node.inputs[1] if len(node.inputs) > 1 else None
    if data is None or axes is None or data.shape is None or len(data.shape) == 0:
        return None
    tensor = convenience.get_const_tensor(axes)
    if tensor is None:
        return None
    rank = len(data.shape)
    return sorted({int(a) % rank for a in tensor.numpy().reshape(-1)})


def rewrite_each_node(
    model: onnx.ModelProto,
    trigger: str | tuple[str, ...],
    rewrite: Callable[[ir.Graph, ir.Node], bool],
    opset_imports: dict[str, int] | None = None,
) -> tuple[onnx.ModelProto, int]:
    """``rewrite`` tried on every node of a model holding a ``trigger`` node (one operator type or
    several); how many it rewrote. The model is deserialized once, whatever the triggers.

    ``opset_imports`` are added when something was rewritten (the domains of the new nodes).
    """
    triggers = (trigger,) if isinstance(trigger, str) else trigger
    if not any(node.op_type in triggers for node in model.graph.node):
        return model, 0
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    rewritten = sum(rewrite(graph, node) for node in list(graph))
    if not rewritten:
        return model, 0
    for domain, version in (opset_imports or {}).items():
        graph.opset_imports.setdefault(domain, version)
    return ir.serde.serialize_model(ir_model), rewritten
