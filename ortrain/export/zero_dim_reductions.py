"""Reductions of a 0-d tensor over its dimension 0 (or -1), reduced as a one-element vector.

PyTorch lets a 0-d tensor name dimension 0 or -1 (``w.prod(0)``, ``vector_norm(w, 2, 0)``,
``w.var(0)``, ``w.gt(0).all(0)``): the result is the element itself, or its function. ONNX's
reductions refuse an axis on a rank-0 input, so ONNX Runtime would not load the region ("axis
must be in [-rank, rank-1]. Input rank was 0", wave 52) and the node ran in PyTorch, or failed
without the fallback policy. Before a region is translated, each such node reduces
``unsqueeze(x, 0)`` over dimension 0 without keepdim instead: the same 0-d result (a 0-d
tensor's keepdim keeps no dimension either). ``max``/``min``/``argmax``/``argmin`` with a
dimension have a 0-d form in onnxscript already (:mod:`ortrain.export.nan_propagation` leaves
them alone); ``amax``/``amin``/``sum``/``mean`` reduce an empty axis list.
"""

from __future__ import annotations

from typing import Any

import torch

from ortrain.export.spelled_out_math import NodeBuilder, rewrite_nodes

aten = torch.ops.aten

# Their results have the rank of the input less the reduced dimensions (the measured failures)
_REDUCTIONS = frozenset(
    {
        aten.linalg_vector_norm.default,
        aten.prod.dim_int,
        aten.var.correction,
        aten.std.correction,
        aten.var_mean.correction,
        aten.std_mean.correction,
        aten.all.dim,
        aten.all.dims,
        aten.any.dim,
        aten.any.dims,
    }
)


def reduce_zero_dim_as_vectors(gm: torch.fx.GraphModule) -> int:
    """Rewrite each reduction of a 0-d tensor over an explicit dimension; returns how many."""
    return rewrite_nodes(gm, _as_vector)


def _as_vector(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op != "call_function" or node.target not in _REDUCTIONS:
        return None
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        return None
    names = [argument.name for argument in node.target._schema.arguments]
    args, kwargs = list(node.args), dict(node.kwargs)
    dim = _argument(names, args, kwargs, "dim")
    if dim is None or dim == []:
        return None  # every dimension: ONNX reduces a 0-d tensor's none, which is right
    _set_argument(names, args, kwargs, "dim", 0 if isinstance(dim, int) else [0])
    if _argument(names, args, kwargs, "keepdim"):
        _set_argument(names, args, kwargs, "keepdim", False)
    b = NodeBuilder(node.graph, value)
    return b.call(node.target, b.call(aten.unsqueeze.default, source, 0), *args[1:], **kwargs)


def _argument(names: list[str], args: list[Any], kwargs: dict[str, Any], name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    index = names.index(name) if name in names else len(args)
    return args[index] if index < len(args) else None


def _set_argument(names: list[str], args: list[Any], kwargs: dict[str, Any], name: str, value: Any) -> None:
    index = names.index(name)
    if index < len(args):
        args[index] = value
    else:
        kwargs[name] = value
