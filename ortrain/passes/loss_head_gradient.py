"""The LM head's gradients without materializing the gradient of the logits.

The loss backward (:mod:`ortrain.capture.loss_backward`) leaves, per row ``n`` of the logits::

    G = ScatterElements(Exp(logp) * a, idx, b, axis=-1, reduction="add")   # a, b, idx: [N, 1]
    dx = G @ W            # MatMul: the hidden state's gradient, W: [V, K]
    dW = G^T @ h          # FusedMatMul(transA=1): the head weight's gradient, h: [N, K]

``G`` is ``diag(a) P + E`` with ``P = Exp(logp)`` and ``E`` one value ``b[n]`` per row at column
``idx[n]``. Both products are linear in ``G``, so::

    dx = a * (P @ W) + b * W[idx]                         # Gather of N rows of W
    dW = ScatterElements(P^T @ (a * h), idx, b * h, axis=0, reduction="add")  # row idx[n] += b[n] h[n]

computes the same values (up to float32 rounding, since ``a`` multiplies before or after the sum)
with two full passes over the ``N × V`` logits fewer: no ``Exp(logp) * a`` and no scatter copy of
it (tiny GPT: ``N × V`` = 1024 × 8000, 32 MiB each), only row-sized work in their place.

Rewritten only when ``G`` feeds nothing but such products (and is no graph output), ``P * a`` feeds
nothing but the scatter, ``a``, ``b`` and ``idx`` hold one value per row (shape ``[N, 1]``), and all
is float32 (the dtype of ONNX Runtime's CPU ``FusedMatMul``).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx
import onnx_ir as ir

from ortrain.passes.node_rewrites import insert_node, rewrite_each_node, take_over_output

logger = logging.getLogger("ortrain.passes")

_MS_DOMAIN = "com.microsoft"


def _is(node: ir.Node | None, op_type: str, domain: str = "") -> bool:
    domains = (domain,) if domain else ("", "ai.onnx")
    return node is not None and node.op_type == op_type and node.domain in domains


def _one_per_row(value: ir.Value) -> bool:
    """``[N, 1]``: one value (or index) per row."""
    shape = value.shape
    return shape is not None and len(shape) == 2 and shape[1] == 1


def _attr(node: ir.Node, name: str, default: object) -> object:
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def _product_role(node: ir.Node, grad: ir.Value) -> str | None:
    """``"dx"`` for ``G @ W``, ``"dw"`` for ``G^T @ h``, None for any other use of ``G``."""
    if len(node.inputs) != 2 or node.inputs[0] is not grad or node.inputs[1] is grad:
        return None
    if _is(node, "MatMul"):
        return "dx"
    if not _is(node, "FusedMatMul", _MS_DOMAIN) or _attr(node, "alpha", 1.0) != 1.0:
        return None
    if any(_attr(node, name, 0) for name in ("transB", "transBatchA", "transBatchB")):
        return None
    return "dw" if _attr(node, "transA", 0) else "dx"


def _float_matrix(value: ir.Value | None) -> bool:
    return (
        value is not None
        and value.dtype == ir.DataType.FLOAT
        and value.shape is not None
        and len(value.shape) == 2
    )


def _rewrite(graph: ir.Graph, scatter: ir.Node) -> bool:
    if not _is(scatter, "ScatterElements") or _attr(scatter, "reduction", "none") != "add":
        return False
    scaled, idx, b = scatter.inputs
    grad = scatter.outputs[0]
    if scaled is None or idx is None or b is None or not _float_matrix(grad) or not _float_matrix(scaled):
        return False
    if _attr(scatter, "axis", 0) not in (1, -1) or not (_one_per_row(idx) and _one_per_row(b)):
        return False
    mul = scaled.producer()
    if not _is(mul, "Mul") or len(scaled.uses()) != 1 or scaled.is_graph_output():
        return False
    assert mul is not None
    p, a = mul.inputs
    if p is None or a is None:
        return False
    if not _one_per_row(a):
        p, a = a, p
    if not _one_per_row(a) or p.shape != scaled.shape or a.dtype != ir.DataType.FLOAT:
        return False
    if grad.is_graph_output() or not grad.uses():
        return False
    products = [(use.node, _product_role(use.node, grad)) for use in grad.uses()]
    if any(role is None for _, role in products):
        return False
    if any(len(node.outputs) != 1 or not _float_matrix(node.inputs[1]) for node, _ in products):
        return False

    for index, (product, role) in enumerate(products):
        other, out = product.inputs[1], product.outputs[0]
        assert other is not None
        tag = f"{scatter.name or 'loss_head'}/{role}_{index}"

        op = functools.partial(insert_node, graph, product, tag)
        if role == "dx":
            # G @ W = a * (P @ W) + b * W[idx]
            axes = op("Constant", [], "axes", value=ir.tensor(np.array([1], dtype=np.int64)))
            rows = op("Squeeze", [idx, axes], "rows")
            picked = op("Mul", [op("Gather", [other, rows], "gather", axis=0), b], "pick")
            result = op("Add", [op("Mul", [op("MatMul", [p, other], "matmul"), a], "scale"), picked], "add")
        else:
            # G^T @ h = P^T @ (a * h), then row n of b * h added at row idx[n]. ScatterElements, not
            # ScatterND: ONNX Runtime 1.32's CPU ScatterND adds rows on several threads at once and
            # loses updates when two rows share a target (see scatter_nd_accumulation.py).
            scaled_h = op("Mul", [other, a], "scale")
            fused = op("FusedMatMul", [p, scaled_h], "matmul", _MS_DOMAIN, alpha=1.0, transA=1, transB=0)
            rows = op("Expand", [idx, op("Shape", [other], "shape")], "rows")
            picked = op("Mul", [other, b], "pick")
            result = op("ScatterElements", [fused, rows, picked], "scatter", axis=0, reduction="add")
        take_over_output(result, out)
        graph.remove(product, safe=True)
    graph.remove(scatter, safe=True)
    graph.remove(mul, safe=True)
    return True


def rewrite_loss_head_gradient(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the rewrite at every match; the model is returned unchanged when nothing matches."""
    model, rewritten = rewrite_each_node(model, "ScatterElements", _rewrite, {_MS_DOMAIN: 1})
    if rewritten:
        logger.info("loss head: %d gradient(s) of the logits no longer materialized", rewritten)
    return model
