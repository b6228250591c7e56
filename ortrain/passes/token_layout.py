"""Which dims of a tensor index one token stream's batch and sequence, followed by data flow.

Padding elimination gathers the real tokens of a dense tensor at the stream's ``(b, t)`` index.
That is right only where the tensor's rows are that stream's tokens in ``(b, t)`` order; a shape
check cannot tell (wave 54: a seq-first ``(T, B, D)`` tensor passed as ``(B, T, D)`` when B == T,
a ``transpose(0, 1).reshape(-1, D)`` as flat ``(b, t)`` rows, a decoder's ``(B, T, D)`` as the
encoder's). So each dim carries a tag learnt from where the tensor came from: ``"b"`` (the
stream's batch), ``"t"`` (its sequence), ``"bt"`` (the two flattened, batch major) or ``None``
(anything else). Ops this module does not know give ``None`` everywhere: the pass then leaves
the op dense, which is always exact.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch

from ortrain.passes.rowwise import expr, is_full_slice, same_size

aten = torch.ops.aten

B, T, BT = "b", "t", "bt"
Tags = tuple[str | None, ...]

# Ops whose output has the broadcast shape of their tensor operands, element by element.
_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.relu.default,
    aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default, aten.neg.default,
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.erf.default, aten.abs.default,
    aten.dropout.default, aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.alias.default, aten.detach.default, aten.type_as.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.maximum.default,
    aten.minimum.default,
}  # fmt: skip
_LAST_DIMS_NORMALIZED = {aten.layer_norm.default, aten.rms_norm.default}
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}


def of_rows(val: torch.Tensor) -> Tags:
    """A tensor the pass lays out itself: a re-padded ``[batch, seq, C]`` or ``[batch * seq, C]``."""
    return (B, T, *(None,) * (val.dim() - 2)) if val.dim() >= 3 else (BT, *(None,) * (val.dim() - 1))


def leading_is_rows(tags: Tags) -> bool:
    """All dims but the features are the stream's (batch, seq) or their flattening, in that order."""
    return tags[:-1] in ((B, T), (BT,))


def propagate(
    node: torch.fx.Node,
    tags_of: Callable[[Any], Tags | None],
    val_of: Callable[[Any], Any],
    rows: tuple[sympy.Expr, sympy.Expr],
) -> Tags:
    """The tags of ``node``'s output from its inputs' (``tags_of``: None for a tensor this stream
    does not reach, a mask or a parameter, which then leaves the tags as they are)."""
    out = val_of(node)
    if isinstance(out, (list, tuple)) and node.target in _SPLITS:  # tags of every piece
        source = _tags(node.args[0], tags_of, val_of)
        dim = node.args[2] if len(node.args) > 2 else 0
        return _without(source, dim)
    if not isinstance(out, torch.Tensor):
        return ()
    tags = _rule(node, out, tags_of, val_of, rows)
    return _checked(tags, out, rows) if len(tags) == out.dim() else (None,) * out.dim()


def _rule(
    node: torch.fx.Node,
    out: torch.Tensor,
    tags_of: Callable[[Any], Tags | None],
    val_of: Callable[[Any], Any],
    rows: tuple[sympy.Expr, sympy.Expr],
) -> Tags:
    target, args = node.target, node.args
    none = (None,) * out.dim()
    if target is operator.getitem and isinstance(args[0], torch.fx.Node) and args[0].target in _SPLITS:
        return tags_of(args[0]) or none
    if node.op != "call_function" or not args:
        return none
    x = _tags(args[0], tags_of, val_of)
    if target in _ELEMENTWISE:
        return _merge(out, [a for a in args if isinstance(a, torch.fx.Node)], tags_of, val_of)
    if target in _SOFTMAX:
        return _without(x, args[1], keep=True)
    if target in _LAST_DIMS_NORMALIZED:
        normalized = len(args[1])
        return (*x[: len(x) - normalized], *(None,) * normalized)
    if target is aten.linear.default:
        return (*x[:-1], None)
    if target in (aten.matmul.default, aten.bmm.default):
        a, b = val_of(args[0]), val_of(args[1])
        if a is None or b is None or a.dim() < 2 or b.dim() < 2:
            return none
        batch = _merge(out, [args[0], args[1]], tags_of, val_of, leading=out.dim() - 2)
        return (*batch, x[-2], None)  # the rows of the left operand; the features are the right's
    if target is aten.scaled_dot_product_attention.default:
        batch = _merge(out, list(args[:3]), tags_of, val_of, leading=out.dim() - 2)
        return (*batch, x[-2], None)  # each query's row
    if target is aten.transpose.int:
        d0, d1 = args[1] % len(x), args[2] % len(x)
        swapped = list(x)
        swapped[d0], swapped[d1] = x[d1], x[d0]
        return tuple(swapped)
    if target is aten.t.default:
        return tuple(reversed(x))
    if target is aten.permute.default:
        return tuple(x[d % len(x)] for d in args[1])
    if target in _RESHAPES:
        return _reshape(x, val_of(args[0]), out, rows)
    if target is aten.unsqueeze.default:
        d = args[1] % out.dim()
        return (*x[:d], None, *x[d:])
    if target is aten.select.int:
        return _without(x, args[1], keep=False)
    if target is aten.slice.Tensor:
        return x if is_full_slice(node) else _without(x, args[1] if len(args) > 1 else 0, keep=True)
    if target is aten.expand.default:
        return (*(None,) * (out.dim() - len(x)), *x)
    if target in _REDUCTIONS:
        dims = args[1] if len(args) > 1 else None
        keep = len(args) > 2 and args[2] is True
        if not isinstance(dims, (list, tuple)) or not dims:
            return none
        reduced = {d % len(x) for d in dims}
        if keep:
            return tuple(None if i in reduced else tag for i, tag in enumerate(x))
        return tuple(tag for i, tag in enumerate(x) if i not in reduced)
    return none


def _tags(arg: Any, tags_of: Callable[[Any], Tags | None], val_of: Callable[[Any], Any]) -> Tags:
    tags = tags_of(arg)
    if tags is not None:
        return tags
    val = val_of(arg)
    return (None,) * val.dim() if isinstance(val, torch.Tensor) else ()


def _without(tags: Tags, dim: Any, *, keep: bool = True) -> Tags:
    """``tags`` with ``dim`` forgotten (``keep``) or removed: an op that mixes or drops that dim."""
    if not isinstance(dim, int) or not tags:
        return (None,) * len(tags) if keep else (None,) * max(len(tags) - 1, 0)
    dim %= len(tags)
    if keep:
        return tuple(None if i == dim else tag for i, tag in enumerate(tags))
    return tuple(tag for i, tag in enumerate(tags) if i != dim)


def _merge(
    out: torch.Tensor,
    operands: list[torch.fx.Node],
    tags_of: Callable[[Any], Tags | None],
    val_of: Callable[[Any], Any],
    leading: int | None = None,
) -> Tags:
    """Broadcasting: each output dim keeps the tag every operand this stream reaches agrees on
    there (an operand broadcast along it, size 1, has no say); any disagreement forgets it."""
    ndim = out.dim() if leading is None else leading
    votes: list[set[str | None]] = [set() for _ in range(ndim)]
    for operand in operands:
        tags, val = tags_of(operand), val_of(operand)
        if tags is None or not isinstance(val, torch.Tensor):
            continue
        dims = len(tags) if leading is None else len(tags) - 2
        offset = ndim - dims
        for d in range(max(dims, 0)):
            if d + offset < 0:
                continue
            if not same_size(val.shape[d], out.shape[d + offset]):
                continue  # broadcast along this dim
            votes[d + offset].add(tags[d])
    return tuple(next(iter(v)) if len(v) == 1 else None for v in votes)


def _reshape(x: Tags, source: Any, out: torch.Tensor, rows: tuple[sympy.Expr, sympy.Expr]) -> Tags:
    """A reshape keeps the tags of the leading dims it leaves alone, and turns (b, t) into bt or
    bt into (b, t) right after them (row-major order makes those the same elements)."""
    tags: list[str | None] = [None] * out.dim()
    if not isinstance(source, torch.Tensor) or len(x) != source.dim():
        return tuple(tags)
    i = 0
    while i < min(source.dim(), out.dim()) and same_size(source.shape[i], out.shape[i]):
        tags[i] = x[i]
        i += 1
    if i == min(source.dim(), out.dim()):
        return tuple(tags)
    flat = rows[0] * rows[1]
    if x[i : i + 2] == (B, T) and sympy.simplify(expr(out.shape[i]) - flat) == 0:
        tags[i] = BT
    elif (
        x[i] == BT
        and i + 1 < out.dim()
        and sympy.simplify(expr(out.shape[i]) - rows[0]) == 0
        and sympy.simplify(expr(out.shape[i + 1]) - rows[1]) == 0
    ):
        tags[i], tags[i + 1] = B, T
    return tuple(tags)


def _checked(tags: Tags, val: torch.Tensor, rows: tuple[sympy.Expr, sympy.Expr]) -> Tags:
    """A tag only where the dim's size is the stream's (a reduction with keepdim leaves size 1)."""
    sizes = {B: rows[0], T: rows[1], BT: rows[0] * rows[1]}
    return tuple(
        tag if tag is not None and sympy.simplify(expr(size) - sizes[tag]) == 0 else None
        for tag, size in zip(tags, val.shape, strict=True)
    )
