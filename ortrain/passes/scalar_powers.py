"""``Pow`` by a constant 1, 2, 3, 0.5, -0.5, -1 or -2 as PyTorch computes it: products, roots,
reciprocals.

ONNX Runtime's CPU ``Pow`` calls ``pow`` once per element: 1.1-1.3 ms on an ``[8, 128, 256]``
float32 activation (onnxruntime 1.32, 2-core AMD EPYC, Zen 5), where ``Mul(x, x)`` takes about a
tenth. Every RMSNorm squares its input (``hidden.pow(2).mean(-1)``: T5, Llama, Mistral, Qwen,
Gemma) and its backward raises to the powers 1 and 3; the tanh GELU (``gelu_new``) cubes. A tiny
T5 spent 16 ms of its 188 ms kernel time in ``Pow``.

PyTorch's own CPU kernel does not call ``pow`` for these exponents either: ``x * x``, ``x * x *
x``, ``1 / (x * x)``, ``sqrt``, ``1 / sqrt``, ``1 / x``, and a copy for 1. Written the same way
here, the values are eager's bit for bit (2^20 float32 and float64 values of every magnitude,
infinities and zeros; NaN where eager has NaN), which ONNX Runtime's ``pow`` are not everywhere:
27 % of them differ at -2 (``pow`` rounds once, ``1 / (x * x)`` twice), 14 % at -0.5, 0.07 % at
-1, and ``pow(-inf, ±0.5)`` is ``+inf`` or 0 where eager gives NaN (at 1, 2 and 3 they agree). The
exception is 0.5, where ONNX Runtime's ``Sqrt`` is correctly rounded and PyTorch's vectorized
``sqrt`` is not always (17 % of float32 values one unit in the last place apart, the same as
``torch.sqrt`` anywhere in ONNX Runtime).

Rewritten: float32 and float64 ``Pow`` whose exponent is a one-element constant equal to one of
the seven, broadcasting nothing (rank 0, or no higher rank than the base's).
"""

from __future__ import annotations

import functools
import logging

import onnx
import onnx_ir as ir
from onnx_ir import convenience

from ortrain.passes.node_rewrites import insert_node, rewrite_each_node, take_over_output

logger = logging.getLogger("ortrain.passes")

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE)


def _exponent(node: ir.Node) -> float | None:
    base, exponent = node.inputs[0], node.inputs[1]
    if base is None or exponent is None or base.dtype not in _FLOATS:
        return None
    tensor = convenience.get_const_tensor(exponent)
    if tensor is None or tensor.size != 1:
        return None
    rank = len(tensor.shape)
    if rank > 0 and (base.shape is None or len(base.shape) < rank):
        return None  # the exponent could widen the result's shape
    return float(tensor.numpy().reshape(()))


def _rewrite(graph: ir.Graph, node: ir.Node) -> bool:
    if node.op_type != "Pow" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    exponent = _exponent(node)
    if exponent not in (1.0, 2.0, 3.0, 0.5, -0.5, -1.0, -2.0):
        return False
    x = node.inputs[0]
    assert x is not None
    op = functools.partial(insert_node, graph, node, node.name or "pow")
    if exponent == 1.0:
        result = op("Identity", [x], "copy")
    elif exponent == 0.5:
        result = op("Sqrt", [x], "sqrt")
    elif exponent == -0.5:
        result = op("Reciprocal", [op("Sqrt", [x], "sqrt")], "rsqrt")
    elif exponent == -1.0:
        result = op("Reciprocal", [x], "reciprocal")
    else:
        square = op("Mul", [x, x], "square")
        if exponent == 2.0:
            result = square
        elif exponent == 3.0:
            result = op("Mul", [square, x], "cube")  # (x * x) * x, PyTorch's order
        else:
            result = op("Reciprocal", [square], "reciprocal_square")
    take_over_output(result, node.outputs[0])
    graph.remove(node, safe=True)
    return True


def powers_as_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each eligible ``Pow`` as PyTorch's kernel computes it; unchanged when none is."""
    model, rewritten = rewrite_each_node(model, "Pow", _rewrite)
    if rewritten:
        logger.debug("%d Pow node(s) by 1, 2, 3, 0.5, -0.5, -1 or -2 as products and roots", rewritten)
    return model
