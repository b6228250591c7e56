"""Give ONNX Runtime the int64 indices its scatter and gather kernels require.

Some onnxscript translations (``unfold_backward``, for one) build ``ScatterND`` with int32
indices, which ONNX allows for no version of the op: ONNX Runtime then refuses the model at
session creation. A ``Cast`` to int64 in front of such an input fixes the model without changing
any value.
"""

from __future__ import annotations

import onnx_ir as ir

# op type -> position of its indices input, for the ops whose indices must be int64 (Gather,
# GatherElements and ScatterElements accept int32 too).
_INDEX_INPUTS = {"ScatterND": 1, "GatherND": 1}


def cast_indices_to_int64(model: ir.Model) -> int:
    """Insert a Cast before every int32 indices input; returns how many were cast."""
    count = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        position = _INDEX_INPUTS.get(node.op_type)
        if node.domain not in ("", "ai.onnx") or position is None or len(node.inputs) <= position:
            continue
        indices = node.inputs[position]
        if indices is None or indices.dtype != ir.DataType.INT32:
            continue
        cast = ir.Node(
            "",
            "Cast",
            [indices],
            attributes=[ir.AttrInt64("to", ir.DataType.INT64)],
            name=f"{node.name}_indices_int64",
        )
        cast.outputs[0].name = f"{indices.name}_int64_{count}"
        cast.outputs[0].dtype = ir.DataType.INT64
        cast.outputs[0].shape = indices.shape
        assert node.graph is not None
        node.graph.insert_before(node, cast)
        node.replace_input_with(position, cast.outputs[0])
        count += 1
    return count
