"""A half-precision tensor multiplied or divided by a number from a size, in float32, as PyTorch.

PyTorch's CPU kernels multiply and divide a float16 or bfloat16 tensor by a Python number in
float32 (the "opmath" type), with the number itself read in float32 (``mul``: ``float(h) *
float(n)``, then rounded once). A graph captured with a size left open holds that number as a
0-d tensor of the tensor's own dtype (:mod:`ortrain.export.number_operands`,
:mod:`ortrain.export.double_precision_sizes`): ``h * (T * 10000)`` rounded ``T * 10000`` to
float16 first, and 90 000 is ``inf`` there, so the loss and every gradient were NaN from the first
dynamic capture on where eager's were finite (wave 44's review); below 65504 the number lost its
low bits (bfloat16 holds 90 000 as 90 112, 0.1 % off). Fixed sizes were right: their numbers are
Python constants, which torch.onnx hands over exactly.

Such a ``mul`` or ``div`` runs here in float32 on the number in float32, and rounds once. ``add``
and ``sub`` stay: PyTorch rounds their number to the tensor's dtype first, as the graph does.
"""

from __future__ import annotations

import torch

from ortrain.export.double_precision_sizes import SIZE_NUMBER
from ortrain.export.spelled_out_math import NodeBuilder, rewrite_nodes

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)
_IN_OPMATH = (aten.mul.Tensor, aten.div.Tensor)


def size_numbers_in_float32(gm: torch.fx.GraphModule) -> int:
    """Rewrite the half-precision ``mul``/``div`` nodes by numbers from sizes (see the module);
    returns how many."""
    return rewrite_nodes(gm, _in_float32)


def _in_float32(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op != "call_function" or node.target not in _IN_OPMATH or len(node.args) != 2:
        return None
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dtype not in _HALF:
        return None
    # ``div``'s number is its divisor (a number divided by a tensor is ``reciprocal`` then ``mul``).
    positions = (0, 1) if node.target is aten.mul.Tensor else (1,)
    for position in positions:
        number, tensor = node.args[position], node.args[1 - position]
        widened = _number_in_float32(number, value.dtype)
        if widened is None or not _tensor_of_dtype(tensor, value.dtype):
            continue
        builder = NodeBuilder(node.graph, value)  # computes in float32, rounds to the node's dtype
        operands = [builder.operand(tensor), builder.operand(tensor)]
        target, args, kwargs = widened
        operands[position] = builder.call(target, *args, **kwargs)
        return builder.rounded(builder.call(node.target, *operands))
    return None


def _number_in_float32(number: object, dtype: torch.dtype) -> tuple[object, tuple, dict] | None:
    """The call making ``number`` in float32 where it is a 0-d ``dtype`` tensor made from a size: a
    ``scalar_tensor`` of a symbolic number, or the rounding of one that double_precision_sizes
    computed in float64 (not a user's ``t.half()``, which eager rounds first too)."""
    if not isinstance(number, torch.fx.Node) or number.op != "call_function":
        return None
    held = number.meta.get("val")
    if not isinstance(held, torch.Tensor) or held.dim() != 0 or held.dtype != dtype:
        return None
    source = number.args[0] if number.args else None
    if not isinstance(source, torch.fx.Node):
        return None
    source_value = source.meta.get("val")
    symbolic = isinstance(source_value, torch.SymInt | torch.SymFloat)
    if number.target is aten.scalar_tensor.default and symbolic:
        return aten.scalar_tensor.default, (source,), {**number.kwargs, "dtype": torch.float32}
    if number.target is aten._to_copy.default and number.meta.get(SIZE_NUMBER):
        return aten._to_copy.default, (source,), {"dtype": torch.float32}
    return None


def _tensor_of_dtype(operand: object, dtype: torch.dtype) -> bool:
    if not isinstance(operand, torch.fx.Node):
        return False
    value = operand.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == dtype
