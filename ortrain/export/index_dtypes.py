"""Give ONNX Runtime the int64 indices its scatter and gather kernels require.

Advanced indexing with int32 index tensors (``table[heads_int64, rel_int32]``, a relative-position
bias; ``flex_attention``'s block mask, written with int32 indices): onnxscript's ``index`` and
``index_put`` combine the index tensors with ``Concat`` and ``Max``, which ONNX Runtime refuses
when their dtypes differ ("Type parameter (T) of Optype (Max) bound to different types"), and the
whole region ran in PyTorch (wave 46's review). Before translation, each int32 index tensor of
those operators is cast to int64 (:func:`int64_advanced_indices`), which changes no value.

Some onnxscript translations (``unfold_backward``, for one) build ``ScatterND`` with int32
indices, which ONNX allows for no version of the op: ONNX Runtime then refuses the model at
session creation. A ``Cast`` to int64 in front of such an input fixes the model without changing
any value.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
import torch

from ortrain.export.spelled_out_math import call_with_value

aten = torch.ops.aten

# Operators of advanced indexing; their list of index tensors is argument 1.
_ADVANCED_INDEXING = frozenset(
    {
        aten.index.Tensor,
        aten._unsafe_index.Tensor,
        aten.index_put.default,
        aten.index_put_.default,
        aten._unsafe_index_put.default,
        aten._index_put_impl_.default,
    }
)


def int64_advanced_indices(gm: torch.fx.GraphModule) -> int:
    """Cast every int32 index tensor of ``gm``'s advanced-indexing nodes to int64; returns how many."""
    cast: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ADVANCED_INDEXING or len(node.args) < 2:
            continue
        indices = node.args[1]
        if not isinstance(indices, list | tuple):
            continue
        widened = [_as_int64(gm.graph, index, cast) for index in indices]
        if any(new is not old for new, old in zip(widened, indices, strict=True)):
            node.update_arg(1, type(indices)(widened))
    if cast:
        gm.graph.lint()
        gm.recompile()
    return len(cast)


def _as_int64(graph: torch.fx.Graph, index: Any, cast: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    """``index`` cast to int64 if it is an int32 tensor (one cast per tensor), else itself."""
    value = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int32:
        return index
    if index not in cast:
        with graph.inserting_after(index):
            cast[index] = call_with_value(
                graph,
                aten._to_copy.default,
                (index,),
                {"dtype": torch.int64},
                fake_mode=getattr(value, "fake_mode", None),
            )
    return cast[index]


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
