"""Token-wise ("row-wise") ops of a pre-dispatch ATen graph, and pushing a row selection past them.

A row is one position of the leading dims (batch, sequence); the last dim holds its features. An
op is row-wise when each output row depends only on the same input row (plus weights): linear,
layer norm, activations, residual adds, dropout, a softmax over the features. Selecting rows
after such an op equals running it on the selected rows only, which is what the sparsity and
compute-optimizer passes exploit.

A *selection* is one of:

- ``index_select(x, 0, idx)`` on a 2-D ``x`` (rows of the flattened leading dims: label sparsity),
- ``select(x, d, i)`` or ``slice(x, d, ...)`` on a leading dim ``d`` (a classifier reading one
  token, a loss reading part of the sequence).

:func:`push_selection_up` finds the largest set of row-wise nodes that only the selection reads
and rebuilds them on the selected rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from ortrain.passes.selected_dropout import draws_a_mask, draws_randomly, eager_mask, mask_drawable

logger = logging.getLogger("ortrain.passes")

aten = torch.ops.aten

# op -> the argument positions that carry rows (other tensor arguments are weights).
_ROW_ARGS: dict[Any, tuple[int, ...]] = {
    aten.linear.default: (0,),
    aten.layer_norm.default: (0,),
    aten.rms_norm.default: (0,),
    aten.gelu.default: (0,),
    aten.relu.default: (0,),
    aten.silu.default: (0,),
    aten.tanh.default: (0,),
    aten.sigmoid.default: (0,),
    aten.neg.default: (0,),
    aten.rsqrt.default: (0,),
    aten.pow.Tensor_Scalar: (0,),
    aten.dropout.default: (0,),
    aten.clone.default: (0,),
    aten.contiguous.default: (0,),
    aten._to_copy.default: (0,),
    aten.to.dtype: (0,),
    aten.to.dtype_layout: (0,),
    aten.add.Tensor: (0, 1),
    aten.sub.Tensor: (0, 1),
    aten.mul.Tensor: (0, 1),
    aten.div.Tensor: (0, 1),
    aten.matmul.default: (0,),
    aten._log_softmax.default: (0,),
    aten.log_softmax.int: (0,),
    aten._softmax.default: (0,),
    aten.softmax.int: (0,),
    aten.mean.dim: (0,),
}
# Ops whose ``dim`` argument (at this position) must name the last dim.
LAST_DIM_ARG = {
    aten._log_softmax.default: 1,
    aten.log_softmax.int: 1,
    aten._softmax.default: 1,
    aten.softmax.int: 1,
    aten.mean.dim: 1,
}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def expr(size: Any) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node.expr)
    if isinstance(size, sympy.Basic):  # already a formula (a size the pass computed)
        return size
    return sympy.Integer(int(size))


def same_size(a: Any, b: Any) -> bool:
    return sympy.simplify(expr(a) - expr(b)) == 0


def value(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


@dataclass(frozen=True)
class Selection:
    """Which rows a selection node keeps, and how to apply it to another tensor of the same rows."""

    node: torch.fx.Node
    kind: str  # "gather" (flat rows), "select" or "slice"
    rows: tuple[Any, ...]  # the leading shape of the selected tensor

    def leading_matches(self, val: torch.Tensor) -> bool:
        if self.kind == "gather":
            if val.dim() < 2:
                return False
            flat = math.prod(expr(s) for s in val.shape[:-1])
            return sympy.simplify(flat - self.rows[0]) == 0
        return val.dim() == len(self.rows) + 1 and all(
            same_size(a, b) for a, b in zip(val.shape[:-1], self.rows, strict=True)
        )

    def apply(self, graph: torch.fx.Graph, tensor: torch.fx.Node) -> torch.fx.Node:
        """Emit the same selection of ``tensor`` (a tensor with the selected tensor's rows)."""
        args = self.node.args
        if self.kind == "gather":
            val = value(tensor)
            assert val is not None
            flat = tensor
            if val.dim() != 2:
                flat = graph.call_function(aten.reshape.default, (tensor, [-1, val.shape[-1]]))
            return graph.call_function(aten.index_select.default, (flat, 0, args[2]))
        return graph.call_function(self.node.target, (tensor, *args[1:]), dict(self.node.kwargs))


def as_selection(node: torch.fx.Node) -> Selection | None:
    """``node`` as a selection of rows, if it is one."""
    if node.op != "call_function" or not node.args:
        return None
    source = value(node.args[0])
    if source is None or source.dim() < 2:
        return None
    if node.target is aten.index_select.default:
        if source.dim() == 2 and node.args[1] == 0:
            return Selection(node, "gather", (expr(source.shape[0]),))
        return None
    if node.target in (aten.select.int, aten.slice.Tensor):
        dim = node.args[1] if len(node.args) > 1 else 0
        if not isinstance(dim, int):
            return None
        dim = dim % source.dim()
        if dim < source.dim() - 1 and not is_full_slice(node):
            kind = "select" if node.target is aten.select.int else "slice"
            return Selection(node, kind, tuple(source.shape[:-1]))
    return None


def is_full_slice(node: torch.fx.Node) -> bool:
    """``x[:, 0:]``-style slices that keep everything (HF's ``logits_to_keep=0``)."""
    if node.target is not aten.slice.Tensor:
        return False
    source, out = value(node.args[0]), value(node)
    if source is None or out is None:
        return False
    return _slice_argument(node, 4, "step", 1) == 1 and tuple(source.shape) == tuple(out.shape)


def _slice_argument(node: torch.fx.Node, position: int, name: str, default: Any) -> Any:
    """An argument of ``slice.Tensor(self, dim=0, start=None, end=None, step=1)``, passed or not:
    TorchScript's trace of ``h[:, t]`` leaves ``dim`` to its default (wave 51's review: an
    IndexError failed such a model's capture)."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def is_leading_reshape(node: torch.fx.Node) -> bool:
    """A reshape that merges or splits leading dims and keeps the features (the last dim)."""
    if node.target not in _RESHAPES:
        return False
    source, out = value(node.args[0]), value(node)
    if source is None or out is None or source.dim() < 1 or out.dim() < 1:
        return False
    return same_size(source.shape[-1], out.shape[-1])


def _names_last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and _names_last_dim(dim[0], ndim)
    return isinstance(dim, int) and dim % ndim == ndim - 1


def row_arguments(
    node: torch.fx.Node,
    matches: Callable[[torch.Tensor], bool],
    *,
    leading_reshapes: bool,
    broadcasts: Callable[[torch.Tensor], bool] = lambda val: val.dim() <= 1,
) -> tuple[int, ...] | None:
    """The row-carrying argument positions of ``node`` if it is row-wise over these rows, else None.

    ``matches`` says whether a tensor has the rows (its leading dims); ``broadcasts`` whether an
    operand without them is one that every row shares (a bias). ``leading_reshapes`` admits
    reshapes that only merge or split the leading dims (rows addressed as one flat dim).
    """
    if node.op != "call_function":
        return None
    out = value(node)
    if out is None or not matches(out):
        return None
    if leading_reshapes and is_leading_reshape(node):
        return (0,)
    if is_full_slice(node):
        dim = _slice_argument(node, 1, "dim", 0) % out.dim()
        return (0,) if dim < out.dim() - 1 else None
    positions = _ROW_ARGS.get(node.target)
    if positions is None:
        return None
    if node.target in LAST_DIM_ARG:
        position = LAST_DIM_ARG[node.target]
        if len(node.args) <= position or not _names_last_dim(node.args[position], out.dim()):
            return None
        if node.target is aten.mean.dim and not (len(node.args) > 2 and node.args[2] is True):
            return None
    if node.target in (aten.layer_norm.default, aten.rms_norm.default) and len(node.args[1]) != 1:
        return None
    if node.target is aten.matmul.default:
        weight = value(node.args[1])
        if weight is None or weight.dim() != 2:
            return None
    for position in positions:
        arg = node.args[position] if position < len(node.args) else None
        val = value(arg)
        if val is None:
            continue  # a Python number
        if not matches(val) and not broadcasts(val):
            return None  # broadcast along the rows in a way a selection would change
    return positions


def _row_args(node: torch.fx.Node, selection: Selection) -> tuple[int, ...] | None:
    return row_arguments(node, selection.leading_matches, leading_reshapes=selection.kind == "gather")


def push_selection_up(graph: torch.fx.Graph, selection_node: torch.fx.Node) -> list[str]:
    """Run the row-wise producers of ``selection_node``'s input on the selected rows only.

    Returns the ops that now run on the selected rows (their ATen names; empty: nothing moved).
    """
    selection = as_selection(selection_node)
    if selection is None:
        return []
    top = selection_node.args[0]
    assert isinstance(top, torch.fx.Node)
    region: dict[torch.fx.Node, tuple[int, ...]] = {}
    allowed_users = {selection_node}
    candidates = [top]
    while candidates:
        node = candidates.pop()
        if node in region or any(user not in allowed_users for user in node.users):
            continue
        positions = _row_args(node, selection)
        if positions is None:
            continue
        region[node] = positions
        allowed_users.add(node)
        for position in positions:
            arg = node.args[position] if position < len(node.args) else None
            if isinstance(arg, torch.fx.Node):
                candidates.append(arg)
        # A node refused earlier may become movable now that one more of its users moved.
        for other in list(region):
            for position in region[other]:
                arg = other.args[position] if position < len(other.args) else None
                if isinstance(arg, torch.fx.Node) and arg not in region:
                    candidates.append(arg)
    if all((selection.kind == "gather" and is_leading_reshape(n)) or is_full_slice(n) for n in region):
        return []  # only reshapes: moving past them saves nothing
    order = {n: i for i, n in enumerate(graph.nodes)}
    if not _draws_as_eager(region, order, selection_node):
        return []
    selected: dict[torch.fx.Node, torch.fx.Node] = {}
    rebuilt: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(selection_node):
        for node in sorted(region, key=order.__getitem__):
            positions = region[node]
            args = list(node.args)
            for position in positions:
                arg = args[position] if position < len(args) else None
                if not isinstance(arg, torch.fx.Node):
                    continue
                if arg in rebuilt:
                    args[position] = rebuilt[arg]
                elif value(arg) is not None and value(arg).dim() > 1:  # type: ignore[union-attr]
                    if arg not in selected:
                        selected[arg] = selection.apply(graph, arg)
                    args[position] = selected[arg]
            if (selection.kind == "gather" and is_leading_reshape(node)) or is_full_slice(node):
                rebuilt[node] = args[0]  # already rows of the selection
                continue
            if node.target in LAST_DIM_ARG:
                position = LAST_DIM_ARG[node.target]
                args[position] = [-1] if isinstance(args[position], (list, tuple)) else -1
            mask = eager_mask(graph, node, next(iter(selected))) if draws_a_mask(node) and selected else None
            if mask is not None:
                new = graph.call_function(aten.mul.Tensor, (args[0], selection.apply(graph, mask)))
            else:
                new = graph.call_function(node.target, tuple(args), dict(node.kwargs))
            rebuilt[node] = new
    selection_node.replace_all_uses_with(rebuilt[top])
    graph.erase_node(selection_node)
    for node in sorted(region, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    return [op_name(n) for n in sorted(region, key=order.__getitem__)]


def _draws_as_eager(
    region: dict[torch.fx.Node, tuple[int, ...]],
    order: dict[torch.fx.Node, int],
    selection_node: torch.fx.Node,
) -> bool:
    """Whether the region's dropouts, rebuilt at the selection, still draw eager's masks in eager's
    order: each one's mask can be drawn densely (:func:`selected_dropout.mask_drawable`), and no
    other draw lies between the first of them and the selection. Wave 44: in a ViT layer the
    attention's output (not contiguous) was dropped on the selected rows only, after the FFN's
    dropouts: other masks than eager's, 0.2 to 0.9 relative off its losses under one seed."""
    dropouts = [n for n in region if draws_a_mask(n)]
    if not dropouts:
        return True
    if not all(mask_drawable(n) for n in dropouts):
        return False
    first, last = min(order[n] for n in dropouts), order[selection_node]
    return not any(first < order[n] < last and n not in region and draws_randomly(n) for n in order)


def op_name(node: torch.fx.Node) -> str:
    """``linear`` for ``aten.linear.default``: the name a log line shows."""
    target = node.target
    return getattr(target, "__name__", str(target)).split(".")[0]


def selections(graph: torch.fx.Graph) -> Sequence[torch.fx.Node]:
    return [n for n in graph.nodes if as_selection(n) is not None]
