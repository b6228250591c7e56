"""Factory calls with their element type spelled out, as the capture recorded it.

``torch.zeros(n, 4)`` traces to ``aten.zeros.default([n, 4])`` without a ``dtype``: PyTorch
takes the default dtype when the node runs, while torch.onnx's translation of a factory without
one makes float32. Under ``torch.set_default_dtype(torch.float64)`` the exported graph then added
a float32 zeros to float64 values (the recorded promotion cast the other operand to float64):
ONNX Runtime had no kernel for that ``Add``, and the split graph failed at its first run, so the
whole model fell back to PyTorch (wave 33). Each value the capture recorded carries the dtype the
node made, and spelling it out gives the same tensor in either library, under any default dtype.
"""

from __future__ import annotations

import torch


def spell_out_factory_dtypes(gm: torch.fx.GraphModule) -> int:
    """Give each factory node of ``gm`` (no tensor operands, a ``dtype`` left unset) the dtype of
    its recorded value; returns how many were changed. Nodes computed from tensors keep theirs:
    their dtype follows their operands, not the default dtype."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.kwargs.get("dtype") is not None:
            continue
        arguments = node.target._schema.arguments
        if not any(argument.name == "dtype" and argument.kwarg_only for argument in arguments):
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        if any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            continue
        node.kwargs = {**node.kwargs, "dtype": value.dtype}
        changed += 1
    if changed:
        gm.recompile()
    return changed
