"""A Python number compared with, or taken as a remainder against, a half-precision tensor is
rounded to the tensor's dtype first, as PyTorch does.

PyTorch's comparison and remainder kernels read such a number as a tensor of the other operand's
dtype: ``x_bf16 >= 1000.3`` compares with 1000 (bfloat16 holds 1000.3 as 1000) and is True at 1000;
``x_bf16 % 0.3`` divides by 0.30078125. Multiplication and division are the exception (their
kernels keep the number in float32, see :mod:`ortrain.export.half_precision_numbers`), and so are
kernels with Python bounds such as hardtanh's backward (ortrain's decomposition compares in float32,
see :mod:`ortrain.capture.decompositions_math`). The translations kept the number exact: bfloat16
comparisons ran in float32 against 1000.3 (False), and the spelled-out remainder
(:mod:`ortrain.export.spelled_out_math`) divided in float32 by 0.3, 0.1 off at 1000 (wave 48's
review). Such a number is replaced here by its rounded value, a Python float again, so that every
translation after this sees the number eager computed with.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)
# The ``.Scalar`` overloads whose number PyTorch rounds to the tensor's dtype; the position of the
# number among the arguments.
_NUMBER_POSITION: dict[Any, int] = {
    **{op.Scalar: 1 for op in (aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.remainder)},
    aten.remainder.Scalar_Tensor: 0,
}


def round_number_operands(gm: torch.fx.GraphModule) -> int:
    """Round the numbers of ``gm``'s half-precision comparisons and remainders (see the module);
    returns how many."""
    rounded = 0
    for node in gm.graph.nodes:
        position = _NUMBER_POSITION.get(node.target) if node.op == "call_function" else None
        if position is None or len(node.args) != 2:
            continue
        number, tensor = node.args[position], node.args[1 - position]
        value = tensor.meta.get("val") if isinstance(tensor, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype not in _HALF:
            continue
        if isinstance(number, bool) or not isinstance(number, int | float):
            continue  # a symbolic size's number is rounded by its own 0-d tensor's dtype
        held = torch.tensor(float(number), dtype=value.dtype).item()  # (an int past int64's range too)
        if held == number or (held != held and number != number):  # already exact (NaN is NaN)
            continue
        args = list(node.args)
        args[position] = float(held)
        node.args = tuple(args)
        rounded += 1
    if rounded:
        gm.recompile()
    return rounded
