"""Transpose -> MatMul as one ``com.microsoft.FusedMatMul`` at the MatMul's place in the graph.

A weight gradient is ``grad_output^T @ input`` (2-D, rows × features). ONNX Runtime's own
``MatMulTransposeFusion`` makes the same ``FusedMatMul``, but as a new node with a new, larger index;
ONNX Runtime orders nodes by index, so every weight-gradient product ran at the end of the backward
run and kept each layer's output gradient (the logits' gradient: 62.5 MiB for the tiny GPT at batch
4, sequence 512) alive until then. Written here, the fused node keeps the exported position, where
the gradient is last read, and its inputs can be freed as soon as the layer is done.

The attention's batched products (``q @ k^T`` and their gradients) are rewritten the same way.
Only float32 products of two operands of one rank (>= 2, no broadcasting of ranks) whose transpose
swaps the last two dims and is read by this MatMul alone are rewritten (ONNX Runtime's CPU kernel is
float32; a 1-D operand is where its fusion once computed wrongly).
"""

from __future__ import annotations

import logging

import onnx
from onnx import TensorProto, helper

logger = logging.getLogger("ortrain.passes")

_MS_DOMAIN = "com.microsoft"


def _ranks_and_types(graph: onnx.GraphProto) -> dict[str, tuple[int, int]]:
    infos = list(graph.value_info) + list(graph.input) + list(graph.output)
    known = {}
    for info in infos:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            known[info.name] = (len(tensor.shape.dim), tensor.elem_type)
    return known


def _rank_if_float(name: str, known: dict[str, tuple[int, int]]) -> int | None:
    rank, element_type = known.get(name, (0, 0))
    return rank if element_type == TensorProto.FLOAT and rank >= 2 else None


def fuse_transposed_matmuls(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace each eligible ``MatMul(Transpose(a), b)`` / ``MatMul(a, Transpose(b))`` in place."""
    graph = model.graph
    nodes = [onnx.NodeProto.FromString(node.SerializeToString()) for node in graph.node]
    known = _ranks_and_types(graph)
    producers = {out: index for index, node in enumerate(nodes) for out in node.output}
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    graph_outputs = {out.name for out in graph.output}

    def transposed(name: str, rank: int) -> int | None:
        index = producers.get(name)
        if index is None:
            return None
        node = nodes[index]
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            return None
        perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
        swap_last_two = [*range(rank - 2), rank - 1, rank - 2]
        if perm != [swap_last_two] or readers.get(name) != 1 or name in graph_outputs:
            return None
        return index if _rank_if_float(node.input[0], known) == rank else None

    dropped: set[int] = set()
    for index, node in enumerate(nodes):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        a, b = node.input
        rank = _rank_if_float(a, known)
        if rank is None or _rank_if_float(b, known) != rank or _rank_if_float(node.output[0], known) != rank:
            continue
        trans_a, trans_b = transposed(a, rank), transposed(b, rank)
        if trans_a is None and trans_b is None:
            continue
        nodes[index] = helper.make_node(
            "FusedMatMul",
            [
                nodes[trans_a].input[0] if trans_a is not None else a,
                nodes[trans_b].input[0] if trans_b is not None else b,
            ],
            list(node.output),
            name=node.name,
            domain=_MS_DOMAIN,
            alpha=1.0,
            transA=int(trans_a is not None),
            transB=int(trans_b is not None),
        )
        dropped.update(t for t in (trans_a, trans_b) if t is not None)
    if not dropped:
        return model
    del graph.node[:]
    graph.node.extend(node for index, node in enumerate(nodes) if index not in dropped)
    if not any(op.domain == _MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    logger.debug("fused %d Transpose -> MatMul pairs in place", len(dropped))
    return model
