"""``Where`` on floating-point tensors as a bit mask: the same bits, a fifth of the time.

ONNX Runtime's CPU ``Where`` walks its output one element at a time on one thread: 212 µs for a
``[64, 1024]`` float32 ReLU gradient (``Where(x <= 0, 0, grad)``), 2 ms on ``[8, 4, 128, 128]``
(onnxruntime 1.32, 2-core AMD EPYC, Zen 5), where a ``Mul`` of the same size takes 11 µs and 105.
It is ReLU's backward (threshold_backward), ``masked_fill``, ``clamp``'s gradient: 20 ms of the
small ResNet's backward, 0.8 of the MLP's 3.5.

Multiplying by a 0/1 mask would be fast and wrong: ``inf * 0`` is NaN where ``Where`` gives 0, and
the gradient of ``sqrt(relu(x))`` is infinite exactly where ReLU's backward drops it. The bits
are multiplied instead: reinterpreted as integers (``BitCast``), with ``c`` the condition as 0 or 1,

    Where(c, x, 0)  = bits⁻¹(bits(x) · c)
    Where(c, x, y)  = bits⁻¹(bits(x) · c + bits(y) · (1 - c))

where one term is always zero and nothing overflows, so the selected element comes out bit for
bit: infinities, NaN payloads, the sign of a zero (ONNX Runtime's own ``Where`` returns +0.0
where the element it selects is -0.0, torch.where -0.0; here both are torch's). Integer products
and sums, not ``BitwiseAnd``/``BitwiseOr``: ONNX Runtime's bitwise kernels run on one thread too
(125 µs on 512 Ki int32 elements, an int32 ``Mul`` 48).

``BitCast`` is ONNX opset 26: the rewrite raises the graph's ``ai.onnx`` import to 26, which
changes no node's meaning in the graphs rewritten (from opset 18, the exports' own, only ``DFT``,
``GridSample`` and ``GroupNormalization`` changed meaning by 26; a graph holding one, or
model-local functions, is left as it is, and so is every graph where the installed ONNX Runtime
has no ``BitCast``). Measured on the ReLU gradient above: 44-56 µs against 238-251, on ``[8, 4,
128, 128]`` 306-507 µs against 2040-2110; in the small ResNet's step ``Where`` took 16.0 ms of
kernel time that the nodes replacing it take 2.8 of.

Rewritten: ``Where`` whose branches are float32, float64, float16 or bfloat16, unless its output
is small (under 16384 elements, counting a symbolic dimension as 64: there the four to nine
nodes cost about what the one does).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper
from onnx_ir import convenience

from ortrain.passes.node_rewrites import insert_node, take_over_output

logger = logging.getLogger("ortrain.passes")

BITCAST_OPSET = 26
# The ai.onnx operators whose meaning (not only their types) changed after opset 18, with the
# opset that changed it: DFT's axis became an input, GridSample's modes were renamed, and
# GroupNormalization's scale and bias went from one per group to one per channel. Every other
# operator's versions up to 26 add types (bfloat16, float8, int4, ...) or an attribute whose
# default keeps the old behaviour (Cast's saturate, AveragePool's dilations, Pad's wrap mode).
_MEANING_CHANGED_AT = {"DFT": 20, "GridSample": 20, "GroupNormalization": 21}
_SMALL = 16384
_SYMBOLIC_DIM = 64
# The integer type of each float type's width, for BitCast and the integer products.
_BITS = {
    ir.DataType.FLOAT: ir.DataType.INT32,
    ir.DataType.DOUBLE: ir.DataType.INT64,
    ir.DataType.FLOAT16: ir.DataType.INT16,
    ir.DataType.BFLOAT16: ir.DataType.INT16,
}


@functools.cache
def runtime_has_bitcast() -> bool:
    """Whether the installed ONNX Runtime runs ``BitCast`` (opset 26) on the CPU: built once."""
    node = helper.make_node("BitCast", ["x"], ["y"], to=onnx.TensorProto.INT32)
    graph = helper.make_graph(
        [node],
        "bitcast_probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", BITCAST_OPSET)])
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:
        logger.debug("ONNX Runtime %s has no BitCast: Where stays as it is", ort.__version__)
        return False
    return True


def _opset_can_rise(model: ir.Model) -> bool:
    opset = model.graph.opset_imports.get("", model.graph.opset_imports.get("ai.onnx"))
    if opset is None or opset >= BITCAST_OPSET:
        return opset is not None
    if model.functions:
        return False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        changed_at = _MEANING_CHANGED_AT.get(node.op_type)
        if node.domain in ("", "ai.onnx") and changed_at is not None and opset < changed_at:
            return False
    return True


def _scalar_bits(value: ir.Value, bits_type: ir.DataType) -> np.ndarray | None:
    """A one-element constant's bits as a rank-0 integer array; None for anything else."""
    constant = convenience.get_const_tensor(value)
    if constant is None or constant.shape.dims != ():
        return None
    return constant.numpy().reshape(()).view(bits_type.numpy())


def _small(value: ir.Value) -> bool:
    """Under _SMALL elements, a symbolic dimension counted as _SYMBOLIC_DIM (a batch, a sequence):
    a label count ``[n]`` is small, ``[batch, 1024]`` is not. An unknown rank is not small."""
    shape = value.shape
    if shape is None:
        return False
    dims = [d if isinstance(d, int) else _SYMBOLIC_DIM for d in shape.dims]
    return int(np.prod(dims, dtype=np.int64)) < _SMALL


def _rewrite(graph: ir.Graph, node: ir.Node) -> bool:
    if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
        return False
    condition, then_value, else_value = node.inputs
    out = node.outputs[0]
    if condition is None or then_value is None or else_value is None:
        return False
    dtype = out.dtype or then_value.dtype or else_value.dtype
    bits_type = _BITS.get(dtype)  # type: ignore[arg-type]
    if bits_type is None or _small(out):
        return False
    op = functools.partial(insert_node, graph, node, node.name or "where")

    def constant(array: np.ndarray, step: str) -> ir.Value:
        return op("Constant", [], step, value=ir.tensor(array))

    # The branch read through the mask is a computed one; a constant scalar branch is the other.
    else_bits = _scalar_bits(else_value, bits_type)
    then_bits = _scalar_bits(then_value, bits_type) if else_bits is None else None
    chosen, other, other_bits = (
        (else_value, then_value, then_bits) if then_bits is not None else (then_value, else_value, else_bits)
    )
    # 1 where the condition holds, 0 elsewhere, and the opposite: the condition's shape, often
    # smaller than the output (a causal mask under every batch and head).
    holds = op("Cast", [condition], "holds", to=bits_type)

    def ones_where(condition_holds: bool) -> ir.Value:
        if condition_holds:
            return holds
        return op("Sub", [constant(np.array(1, dtype=bits_type.numpy()), "one"), holds], "fails")

    # Multiplying the bits by 1 or 0 and adding a zero to them keeps them exactly (see above).
    chosen_is_then = chosen is then_value
    kept = op("Mul", [op("BitCast", [chosen], "bits", to=bits_type), ones_where(chosen_is_then)], "kept")
    if other_bits is not None and not other_bits.any():
        selected = kept  # the other branch is +0.0: all its bits are zero
    else:
        if other_bits is not None:
            base = constant(other_bits, "other_bits")
        else:
            base = op("BitCast", [other], "other_bits", to=bits_type)
        other_kept = op("Mul", [base, ones_where(not chosen_is_then)], "other_kept")
        selected = op("Add", [kept, other_kept], "selected")
    result = op("BitCast", [selected], "where", to=dtype)
    take_over_output(result, out)
    graph.remove(node, safe=True)
    return True


def select_by_bit_mask(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every eligible floating-point ``Where`` as a bit mask; unchanged when none is, or when the
    graph's opset cannot rise to 26 (see the module's docstring)."""
    if not any(node.op_type == "Where" for node in model.graph.node) or not runtime_has_bitcast():
        return model
    ir_model = ir.serde.deserialize_model(model)
    if not _opset_can_rise(ir_model):
        logger.debug("Where kept: the graph holds an operator whose meaning changed by opset 26")
        return model
    graph = ir_model.graph
    rewritten = sum(_rewrite(graph, node) for node in list(graph))
    if not rewritten:
        return model
    graph.opset_imports.pop("ai.onnx", None)
    graph.opset_imports[""] = max(BITCAST_OPSET, graph.opset_imports.get("", 0))
    logger.debug("%d Where node(s) as bit masks (graph now at opset %d)", rewritten, BITCAST_OPSET)
    return ir.serde.serialize_model(ir_model)
