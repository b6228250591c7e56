"""Python numbers in the tensor operands of ATen operators become 0-dimensional tensors for export.

PyTorch accepts a number where an operator's schema asks for a tensor, and AOTAutograd's graphs
keep it there: ``1.0 - x`` decomposes to ``aten.sub.Tensor(1.0, x)``, ``1.0 // x`` is
``aten.floor_divide.default(1.0, x)``. torch.onnx's translator cannot take such a node (no
overload of ``sub`` takes a number first; onnxscript's ``floor_divide`` reads ``self.dtype``), and
the export of the whole region failed: ProphetNet's forward ran 155 nodes in PyTorch, IBert's 65.

In the elementwise operators whose two operands promote together, such a number becomes an
``aten.scalar_tensor`` of the dtype PyTorch gives the number against the other operand
(``torch.result_type``): a 0-dimensional tensor of that dtype promotes with the other operand to
the same dtype, so the node's value and dtype stay.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_aten = torch.ops.aten
_prims = torch.ops.prims
# Elementwise operators whose two operands promote together: positions 0 and 1 (``where``: 1, 2).
_PAIRED_OPERANDS: dict[Any, tuple[int, int]] = {
    **{
        packet: (0, 1)
        for packet in (
            _aten.add, _aten.sub, _aten.mul, _aten.div, _aten.floor_divide, _aten.remainder,
            _aten.fmod, _aten.pow, _aten.atan2, _aten.maximum, _aten.minimum, _aten.eq, _aten.ne,
            _aten.lt, _aten.le, _aten.gt, _aten.ge, _aten.bitwise_and, _aten.bitwise_or,
            _aten.bitwise_xor,
        )
    },
    _aten.where: (1, 2),
    # A reference's decomposition at a symbolic size (``torch._refs.mean``: ``sum / n``).
    **{packet: (0, 1) for packet in (_prims.add, _prims.sub, _prims.mul, _prims.div)},
}  # fmt: skip


def _size_as_tensor_operand(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """``x % n`` with ``n`` a size of the call (``i % x.shape[0]``, a ``.Scalar`` overload whose
    number is a symbolic size): the ``.Tensor`` overload on a 0-d tensor of it, which torchlib
    translates (its ``.Scalar`` translation makes a constant of the number, and failed on a size
    known only at run time: wave 41, the region then ran in PyTorch)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    packet = node.target.overloadpacket
    if node.target._overloadname != "Scalar" or packet not in _PAIRED_OPERANDS or len(node.args) != 2:
        return False
    tensor, number = node.args
    tensor_overload = getattr(packet, "Tensor", None)
    value = tensor.meta.get("val") if isinstance(tensor, torch.fx.Node) else None
    size = number.meta.get("val") if isinstance(number, torch.fx.Node) else None
    if tensor_overload is None or not isinstance(value, torch.Tensor) or not isinstance(size, torch.SymInt):
        return False
    dtype = torch.result_type(torch.empty((1,) * min(value.dim(), 1), dtype=value.dtype), 1)
    with gm.graph.inserting_before(node):
        operand = gm.graph.call_function(_aten.scalar_tensor.default, (number,), {"dtype": dtype})
    with value.fake_mode if hasattr(value, "fake_mode") else contextlib.nullcontext():
        operand.meta["val"] = torch.scalar_tensor(size, dtype=dtype, device=value.device)
    node.target = tensor_overload
    node.args = (tensor, operand)
    return True


def tensors_for_number_operands(gm: torch.fx.GraphModule) -> int:
    """Replace the numbers held in tensor operands of ``gm``'s elementwise calls; returns how many."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if _size_as_tensor_operand(gm, node):
            replaced += 1
            continue
        found = _number_operand(node)
        if found is None:
            continue
        position, other = found
        number = node.args[position]
        # PyTorch's own rule for a tensor and a number (a 0-dimensional tensor of that dtype then
        # promotes with the other operand to the same dtype).
        probe = torch.empty((1,) * min(other.dim(), 1), dtype=other.dtype)
        dtype = _holding(number, torch.result_type(probe, _kind_of(number)))
        with gm.graph.inserting_before(node):
            operand = gm.graph.call_function(_aten.scalar_tensor.default, (number,), {"dtype": dtype})
        with other.fake_mode if hasattr(other, "fake_mode") else contextlib.nullcontext():
            value = number.meta["val"] if isinstance(number, torch.fx.Node) else number
            operand.meta["val"] = torch.scalar_tensor(value, dtype=dtype, device=other.device)
        args = list(node.args)
        args[position] = operand
        node.args = tuple(args)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def _holding(number: Any, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or int64 for an int it cannot hold: ``q / 128`` of an int8 tensor divides by 128
    in eager (true division computes in float), and an int8 0-d tensor of it was -128 (wave 48's
    review: every dequantized sign flipped). Within the integers a 0-d tensor's dtype does not
    change the promotion, so the node's value and dtype stay eager's."""
    if type(number) is not int or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return dtype
    limits = torch.iinfo(dtype)
    return dtype if limits.min <= number <= limits.max else torch.int64


def _number_operand(node: torch.fx.Node) -> tuple[int, torch.Tensor] | None:
    """The position of a number in a tensor operand of ``node`` and the other operand's value."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    pair = _PAIRED_OPERANDS.get(node.target.overloadpacket)
    if pair is None or len(node.args) <= max(pair):
        return None
    schema = node.target._schema.arguments
    for position, other_position in (pair, pair[::-1]):
        number, other = node.args[position], node.args[other_position]
        if (
            isinstance(schema[position].type, torch.TensorType)
            and (isinstance(number, (bool, int, float)) or _is_symbolic_number(number))
            and isinstance(other, torch.fx.Node)
            and isinstance(other.meta.get("val"), torch.Tensor)
        ):
            return position, other.meta["val"]
    return None


def _is_symbolic_number(operand: Any) -> bool:
    """A node computing a number from sizes (``sym_float(s0)``), passed where a tensor goes: as a
    0-d tensor, a float64 graph computes it in float64 (:mod:`double_precision_sizes`), where
    torch.onnx's ``sym_float`` is float32 (a float64 batch norm at a new batch size then divided
    double by float, which ONNX Runtime has no kernel for: wave 44)."""
    return isinstance(operand, torch.fx.Node) and isinstance(
        operand.meta.get("val"), (torch.SymInt, torch.SymFloat)
    )


def _kind_of(number: Any) -> bool | int | float:
    """``number``, or for a symbolic one a number of its kind (what promotion reads)."""
    if isinstance(number, torch.fx.Node):
        return 1.0 if isinstance(number.meta["val"], torch.SymFloat) else 1
    return number
