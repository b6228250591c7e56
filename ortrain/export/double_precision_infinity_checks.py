"""``isinf``, ``isposinf`` and ``isneginf`` of a float64 tensor, compared in float64.

onnxscript translates the three as ``IsInf(Cast(x, FLOAT))``: a float64 value beyond float32's
range (-1.8e308, Hugging Face's ``torch.finfo(torch.float64).min`` mask) becomes infinite on the
way, and the check says True where PyTorch says False. In the attention math form
(:mod:`ortrain.export.flash_attention_math`), a query row masked with that number was taken for a
fully masked one and zeroed, its gradients too (wave 49's review; eager averages the values).
Here each becomes an equality with infinity in the tensor's own dtype, which needs no cast.
"""

from __future__ import annotations

import math

import torch

from ortrain.export.spelled_out_math import call_with_value, rewrite_nodes

aten = torch.ops.aten

_CHECKS = {aten.isinf.default, aten.isposinf.default, aten.isneginf.default}


def infinity_checks_in_double(gm: torch.fx.GraphModule) -> int:
    """Rewrite the float64 infinity checks of ``gm`` (see the module); returns how many."""
    return rewrite_nodes(gm, _in_double)


def _in_double(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op != "call_function" or node.target not in _CHECKS or len(node.args) != 1:
        return None
    (x,) = node.args
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float64:
        return None
    mode = getattr(value, "fake_mode", None)
    if node.target is aten.isinf.default:
        x = call_with_value(node.graph, aten.abs.default, (x,), fake_mode=mode)
    infinity = -math.inf if node.target is aten.isneginf.default else math.inf
    return call_with_value(node.graph, aten.eq.Scalar, (x, infinity), fake_mode=mode)
