"""Numbers computed from sizes, computed in float64, as Python computes them.

A graph captured with a size left open computes some numbers from it: ``var``'s backward scales
by ``2 / (n - 1)``, ``mse_loss``'s by ``2 / numel``, batch norm's statistics by ``1 / n``,
``interpolate``'s nearest source index by ``n / (n * scale_factor)``. They are Python arithmetic
on symbolic sizes (``sym_float``, ``truediv``, ``sub``) whose result becomes a 0-d tensor
(``scalar_tensor``), and torch.onnx translates that arithmetic in float32 whatever the graph's
type. In a float64 model those gradients were 3e-8 to 6e-8 relative off eager's from the first
dynamic capture on (wave 42), where every fixed-size graph agrees to 1e-16; in a float32 model,
``17 / (17 * 0.6)`` in float32 is 1.6666665 where Python's is 1.6666667, and nearest
interpolation at scale 0.6 read row 4 where eager reads row 5 (wave 44: wrong losses and
gradients from the second image size on).

Each such ``scalar_tensor`` is rebuilt here as float64 tensor arithmetic on the integer sizes (an
int64 size converts to float64 exactly), with the Python numbers as float64 constants, and cast
once to the ``scalar_tensor``'s dtype, as Python rounds its double once there; a number read from
a float64 tensor (a backward's input the forward computed) is that tensor.
:mod:`ortrain.export.fx_to_onnx` hands a float64 graph's numbers over as float64 tensors too. An
expression with an operation not handled below is left as it was.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ortrain.export.double_precision_constants import DoubleConstant
from ortrain.export.spelled_out_math import NodeBuilder, rewrite_nodes

aten = torch.ops.aten

_BINARY = {
    operator.add: aten.add.Tensor,
    operator.sub: aten.sub.Tensor,
    operator.mul: aten.mul.Tensor,
    operator.truediv: aten.div.Tensor,
    # ``T ** 0.5`` of a length (a scale): 3e-8 relative off in a float64 model (wave 50's review).
    operator.pow: aten.pow.Tensor_Tensor,
}


# Marks the node rounding such a number to the graph's dtype (a user's own ``t.half()`` is not one).
SIZE_NUMBER = "ortrain_size_number"


class _Unhandled(Exception):
    pass


def sizes_as_double(gm: torch.fx.GraphModule) -> int:
    """Rebuild the ``scalar_tensor`` nodes of symbolic floats in float64 (see the module); returns
    how many."""
    return rewrite_nodes(gm, _in_double)


def _in_double(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        _number_arguments_in_double(node)
    if node.op != "call_function" or node.target is not aten.scalar_tensor.default:
        return None
    source, value = node.args[0], node.meta.get("val")
    if type(source) is float and isinstance(value, torch.Tensor) and value.dtype == torch.float64:
        # ``scalar_tensor(3.3, dtype=float64)`` (a capture's own form of ``(n - 0.5) / 3.3``):
        # torch.onnx would hold 3.29999995, through a float32 constant (wave 44: 1.4e-8 off).
        node.args = (DoubleConstant(source), *node.args[1:])
        return None
    if not isinstance(source, torch.fx.Node) or not isinstance(source.meta.get("val"), torch.SymFloat):
        return None
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        return None
    builder = NodeBuilder(node.graph, value)
    try:
        number = _tensor_of(builder, source)
    except _Unhandled:
        return None
    if value.dtype != torch.float64:
        rounded = builder.call(aten._to_copy.default, number, dtype=value.dtype)
        rounded.meta[SIZE_NUMBER] = True  # read by half_precision_numbers
        return rounded
    return number


def _number_arguments_in_double(node: torch.fx.Node) -> None:
    """A symbolic float passed where the operator takes a number (``clamp(min=n / (n * 0.6) * 3)``,
    ``full_like(x, v)``): computed as a float64 tensor, rounded once to the operator's dtype, and
    read back as a number (wave 44: 4.9999995 where Python's is 5.0, and its floor 4)."""
    # Most nodes pass none: the schema is read only for those that do (every node of every export
    # comes through here).
    numbers = [(i, a) for i, a in enumerate(node.args) if _symbolic_float(a)]
    numbers += [(k, a) for k, a in node.kwargs.items() if _symbolic_float(a)]
    if not numbers:
        return
    result = node.meta.get("val")
    values = list(result) if isinstance(result, tuple | list) else [result]
    fake = next((v for v in values if isinstance(v, torch.Tensor)), None)
    if fake is None:
        return
    if fake.dtype == torch.float64:
        # torch.onnx reads a number back as FLOAT (its ``_local_scalar_dense``): in a float64
        # graph that would round what this computed exactly. Left as it is (6e-8 relative).
        return
    dtype = torch.float32  # what that FLOAT holds exactly: rounded once, from float64
    arguments = node.target._schema.arguments  # type: ignore[union-attr]
    by_name = {argument.name: argument for argument in arguments}
    # In the fake mode of the graph's inputs, which the number's own tensors (a backward's number
    # input) share; a node's value can hold another (wave 44: "Mixing fake modes").
    inputs = _input_value(node.graph)
    builder = NodeBuilder(node.graph, fake if inputs is None else inputs)
    for where, number in numbers:
        if isinstance(where, int):
            argument = arguments[where] if where < len(arguments) else None
        else:
            argument = by_name.get(where)
        if argument is None or isinstance(argument.type, torch.TensorType):
            continue
        try:
            exact = _tensor_of(builder, number)
        except _Unhandled:
            continue
        rounded = builder.call(aten._to_copy.default, exact, dtype=dtype)
        read = node.graph.call_function(aten._local_scalar_dense.default, (rounded,))
        read.meta["val"] = number.meta["val"]
        if isinstance(where, int):
            node.args = (*node.args[:where], read, *node.args[where + 1 :])
        else:
            node.kwargs = {**node.kwargs, where: read}


def _symbolic_float(argument: Any) -> bool:
    return isinstance(argument, torch.fx.Node) and isinstance(argument.meta.get("val"), torch.SymFloat)


def _input_value(graph: torch.fx.Graph) -> torch.Tensor | None:
    values = (n.meta.get("val") for n in graph.nodes if n.op == "placeholder")
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _tensor_of(builder: NodeBuilder, number: Any) -> torch.fx.Node:
    """``number`` (a Python number, or a node computing a symbolic one) as a float64 0-d tensor."""
    if isinstance(number, bool) or not isinstance(number, (int, float, torch.fx.Node)):
        raise _Unhandled(number)
    if not isinstance(number, torch.fx.Node):
        return builder.call(aten.scalar_tensor.default, DoubleConstant(number), dtype=torch.float64)
    value = number.meta.get("val")
    if isinstance(value, torch.SymInt):  # a size, or integer arithmetic on sizes: exact as int64
        return builder.call(aten.scalar_tensor.default, number, dtype=torch.float64)
    if number.op != "call_function" or not isinstance(value, torch.SymFloat):
        raise _Unhandled(number)
    if number.target is aten._local_scalar_dense.default:
        # A number the forward passed as a float64 tensor (the backward's ``1 / n``): that tensor.
        source = number.args[0]
        held = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(held, torch.Tensor) or held.dtype != torch.float64:
            raise _Unhandled(number)
        return builder.call(aten.reshape.default, source, [])
    if number.target is torch.sym_float:
        return _tensor_of(builder, number.args[0])
    if number.target is operator.neg:
        return builder.call(aten.neg.default, _tensor_of(builder, number.args[0]))
    target = _BINARY.get(number.target)
    if target is None or len(number.args) != 2:
        raise _Unhandled(number)
    return builder.call(target, *(_tensor_of(builder, a) for a in number.args))
