"""The exact GELU's elementwise chain as one ``com.microsoft.Gelu`` node.

The exporter writes ``gelu(x)`` (``approximate="none"``) as five nodes, each one pass over the
activation: ``Div(x, √2) → Erf → Add(1) → Mul(0.5) → Mul(x)``. ONNX Runtime's CPU build has a
one-pass ``Gelu`` kernel (contrib domain, float32), but its own ``GeluFusion`` does not match the
order the exporter writes (``Mul(0.5, ·)`` before ``Mul(x, ·)``), so the chain ran as written:
0.94 ms against 0.31 ms on an ``[8, 128, 1024]`` activation (2-core AMD EPYC, both in ONNX Runtime,
largest difference 2.4e-7).

Rewritten only where the chain's intermediate values feed nothing else (the matcher checks it):
a backward graph that reads ``erf(x / √2)`` keeps its chain. The constants must be scalars (or
one-element tensors) equal to √2, 1 and 0.5 in float32, and ``x`` float32.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

logger = logging.getLogger("ortrain.passes")

_MS_DOMAIN = "com.microsoft"


def _chain(op, x, sqrt2, one, half):  # type: ignore[no-untyped-def]
    return op.Mul(x, op.Mul(half, op.Add(op.Erf(op.Div(x, sqrt2)), one)))


def _gelu(op, x, sqrt2, one, half):  # type: ignore[no-untyped-def]
    return op.Gelu(x, _domain=_MS_DOMAIN)


def _scalar_equals(value: ir.Value, expected: float) -> bool:
    constant = value.const_value
    if constant is None:
        return False
    array = constant.numpy()
    if array.size != 1 or array.dtype != np.float32:
        return False
    return math.isclose(float(array.item()), expected, rel_tol=1e-6)


def _matches(context, x, sqrt2, one, half) -> bool:  # type: ignore[no-untyped-def]
    del context
    return (
        x.dtype == ir.DataType.FLOAT
        and _scalar_equals(sqrt2, math.sqrt(2.0))
        and _scalar_equals(one, 1.0)
        and _scalar_equals(half, 0.5)
    )


# Both operand orders of the Add and the two Muls: the exporter's, and any other.
_RULES = pattern.RewriteRuleSet([pattern.RewriteRule(_chain, _gelu, _matches, name="erf_gelu")], commute=True)


def fuse_erf_gelu(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each exact-GELU chain of ``model`` whose intermediates nothing else reads, as one ``Gelu``."""
    if not any(node.op_type == "Erf" for node in model.graph.node):
        return model
    ir_model = ir.serde.deserialize_model(model)
    initializers = ir_model.graph.initializers
    read = {name for name, value in initializers.items() if value.uses()}
    # The rule alone, no clean-up passes, so the rest of the graph reaches ONNX Runtime as it was.
    # The rewriter imports the com.microsoft domain for the nodes it makes.
    fused = _RULES.apply_to_model(ir_model)
    if not fused:
        return model
    for name in read:  # the chains' constants, now read by nothing
        value = initializers[name]
        if not value.uses() and not value.is_graph_output():
            initializers.pop(name)
    logger.info("erf GELU: %d chain(s) of five nodes now one com.microsoft.Gelu each", fused)
    return ir.serde.serialize_model(ir_model)
