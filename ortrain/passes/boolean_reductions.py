"""``all`` and ``any`` over a boolean tensor reduced as bytes, not as 64-bit integers.

The exporter writes ``torch.all(mask, dim)`` as ``Cast(mask → int64) → ReduceMin → Cast(→ bool)``
(``any``: ``ReduceMax``). ONNX Runtime's CPU ``ReduceMin`` over int64 is slow: 1.05 ms over the
last axis of an ``[8, 8, 128, 128]`` mask, where the same reduction over uint8 takes 0.12 ms
(onnxruntime 1.32, 2-core AMD EPYC, Zen 5). PyTorch's safe softmax (``_safe_softmax``, rows of
attention scores that are all ``-inf``) asks it once per attention layer, forward and backward:
12 a step on a tiny T5, 8 ms of kernel time.

The values are 0 and 1 either way, so the reduction is the same. Over an empty set ``ReduceMax``
gives the type's smallest value, ``INT64_MIN`` (true as a boolean) where uint8's is 0 (false): the
bytes give ``torch.any``'s answer for an empty dimension, false, where int64's gave true.

Rewritten: ``ReduceMin``/``ReduceMax`` of a ``Cast`` from bool whose output only ``Cast``\\ s to
bool read (no graph output); each such reduction reads a uint8 ``Cast`` of its own, and the int64
one stays only where something else reads it (``m.sum(-1)`` beside ``m.any(-1)``).
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from ortrain.passes.node_rewrites import insert_node, rewrite_each_node

logger = logging.getLogger("ortrain.passes")

_REDUCTIONS = ("ReduceMin", "ReduceMax")


def _is_cast(node: ir.Node, to: ir.DataType | None = None) -> bool:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return False
    target = node.attributes.get("to")
    return target is not None and (to is None or ir.DataType(target.value) == to)


def _rewrite(graph: ir.Graph, node: ir.Node) -> bool:
    if node.op_type not in _REDUCTIONS or node.domain not in ("", "ai.onnx") or not node.inputs:
        return False
    data, out = node.inputs[0], node.outputs[0]
    cast = data.producer() if data is not None else None
    if data is None or cast is None or not _is_cast(cast):
        return False
    source = cast.inputs[0]
    if source is None or source.dtype != ir.DataType.BOOL or out.is_graph_output():
        return False
    if not out.uses() or not all(_is_cast(use.node, ir.DataType.BOOL) for use in out.uses()):
        return False
    # A cast of its own: the exporter casts a mask once for all its readers (``m.any(-1)`` beside
    # ``m.all(-1)`` or ``m.sum(-1)``), and until wave 41 a shared cast kept int64's ``any`` of an
    # empty dimension (true).
    tag = node.name or f"{node.op_type}_{id(node)}"
    as_bytes = insert_node(graph, node, tag, "Cast", [source], "as_bytes", to=int(ir.DataType.UINT8))
    as_bytes.dtype, as_bytes.shape = ir.DataType.UINT8, data.shape
    node.replace_input_with(0, as_bytes)
    out.dtype = ir.DataType.UINT8
    if not data.uses() and not data.is_graph_output():
        graph.remove(cast, safe=True)
    return True


def reduce_booleans_as_bytes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each eligible ``all``/``any`` reduction over uint8; unchanged when none is."""
    model, rewritten = rewrite_each_node(model, _REDUCTIONS, _rewrite)
    if rewritten:
        logger.debug("%d ReduceMin/ReduceMax of a boolean mask reduced over uint8", rewritten)
    return model
