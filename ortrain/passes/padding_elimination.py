"""Padding elimination (``ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER``): token-wise layers skip pad tokens.

At an ``embedding`` with a ``padding_idx`` (BERT's word embeddings, say), the real tokens are
gathered into one ``[tokens, features]`` tensor:

    idx = nonzero(input_ids.view(-1) != padding_idx).view(-1)
    rows = embedding(weight, input_ids.view(-1).index_select(0, idx))

and every token-wise op downstream (linear, layer norm, activations, residual adds, dropout) runs
on those rows. Where the layout matters (attention, a reduction over the sequence, a graph
output) the rows are scattered back into a zero-padded ``[batch, seq, C]`` tensor; a linear that
reads such a tensor (the attention output projection) gathers the real tokens again, where data
flow shows its rows are still this stream's tokens in (batch, seq) order (``token_layout.py``; a
shape alone cannot tell a seq-first layout or another padded stream apart). Nothing to move:
the pass declines, saying so at INFO.

Exact for every position that is not a pad, hence for the loss and all gradients, as long as
the model ignores pad positions (an attention mask hides pad keys, the loss ignores pad labels):
pad rows then only ever meet a zero attention weight or an ignored label. Outputs at pad
positions are 0 instead of whatever the dense model computed there. That condition is the
user's to know, which is why the switch is off by default (as upstream).

Two ways a model reads pads even so are made exact by keeping those positions among the real
tokens: a ``select`` of one sequence position (BERT's pooler reads token 0, a pad in a
left-padded row; a classifier on the last token of a right-padded one), and a row that is all
padding, whose attention has no real key and averages over the pads (its every position is
kept, so it runs as in the dense model). Both cost only the rows they keep.
"""

from __future__ import annotations

import copy
import logging
import operator
import warnings
from typing import Any

import sympy
import torch
from torch.fx.node import map_arg

from ortrain.passes.rowwise import LAST_DIM_ARG, expr, is_full_slice, is_leading_reshape, row_arguments, value
from ortrain.passes.token_layout import Tags, leading_is_rows, of_rows, propagate

logger = logging.getLogger("ortrain.passes")

aten = torch.ops.aten
_HEAVY = {aten.linear.default, aten.matmul.default}
# Position-by-position ops: a [batch, seq] result still has position (b, t) at (b, t) (cumsum only
# along the sequence, checked where it is used).
_GRID_KEEPING = {
    aten.ne.Scalar, aten.eq.Scalar, aten.ne.Tensor, aten.eq.Tensor, aten.add.Tensor, aten.add.Scalar,
    aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten._to_copy.default,
    aten.to.dtype, aten.type_as.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten.masked_fill.Scalar, aten.cumsum.default,
}  # fmt: skip


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.simplify(a - b) == 0


# A slice of more leading positions than this is a read of the sequence, not of a few tokens.
_POSITIONS_READ_AT_MOST = 8
_TO_THE_END = 2**62  # a slice's end at or past this is "to the end" (PyTorch writes 2**63 - 1)


class _CannotExpress(Exception):
    pass


class _Eliminator:
    def __init__(self, graph: torch.fx.Graph, embedding: torch.fx.Node, ids: torch.fx.Node, pad: int) -> None:
        self.graph = graph
        self.embedding = embedding
        self.ids = ids
        self.pad = pad
        ids_val = value(ids)
        assert ids_val is not None
        self.rows = tuple(expr(s) for s in ids_val.shape)
        self.flat_rows = self.rows[0] * self.rows[1]
        self.sparse: dict[torch.fx.Node, torch.fx.Node] = {}
        self.repadded: dict[torch.fx.Node, torch.fx.Node] = {}
        # Every dense value computed from a re-padded one, with which of its dims are this
        # stream's batch and sequence (token_layout.py): only those rows may be gathered again.
        self.layout: dict[torch.fx.Node, Tags] = {}
        self.vals: dict[torch.fx.Node, torch.Tensor] = {}  # the re-padded nodes' values
        # Values computed from another padded stream (a decoder's ids looked up in the same or
        # another table): their pads lie elsewhere, so their rows are never this stream's.
        self.foreign: set[torch.fx.Node] = set()
        self.index: torch.fx.Node | None = None
        self.read_positions: list[int] = []  # sequence positions a select reads after re-padding

    # ---- shapes ----------------------------------------------------------------------------
    def has_rows(self, val: torch.Tensor) -> bool:
        """Leading dims are (batch, seq), or those flattened into one."""
        if val.dim() < 2:
            return False
        leading = [expr(s) for s in val.shape[:-1]]
        if len(leading) == 2 and all(_same(a, b) for a, b in zip(leading, self.rows, strict=True)):
            return True
        return len(leading) == 1 and _same(leading[0], self.flat_rows)

    def broadcasts(self, val: torch.Tensor) -> bool:
        """A bias ``[C]`` or a tensor such as position embeddings ``[1, seq, C]`` broadcast over rows;
        a ``[seq, C]`` one (a position table as an ``nn.Parameter(T, D)``) broadcasts over the batch
        the same way (``gather`` expands it to ``[batch, seq, C]`` first)."""
        if val.dim() <= 1:
            return True
        if val.dim() not in (2, 3):
            return False
        leading = [expr(s) for s in val.shape[:-1]]
        wanted = self.rows[-len(leading) :]
        return all(a == 1 or _same(a, b) for a, b in zip(leading, wanted, strict=True))

    def size_node(self, size: Any) -> Any:
        """A graph value for ``size`` (an int, or batch / seq / batch*seq of the ids)."""
        e = expr(size)
        if e.is_Integer:
            return int(e)
        if sympy.simplify(e - self.rows[0]) == 0:
            return self._dim(0)
        if sympy.simplify(e - self.rows[1]) == 0:
            return self._dim(1)
        if sympy.simplify(e - self.flat_rows) == 0:
            return self.graph.call_function(operator.mul, (self._dim(0), self._dim(1)))
        raise _CannotExpress(str(e))

    def _dim(self, dim: int) -> torch.fx.Node:
        return self.graph.call_function(aten.sym_size.int, (self.ids, dim))

    # ---- the two conversions ---------------------------------------------------------------
    def gather(self, node: torch.fx.Node) -> torch.fx.Node:
        """The real-token rows of a dense ``node`` (broadcast over rows first where it is a bias-like)."""
        val = value(node)
        assert val is not None and self.index is not None
        source = node
        if not self.has_rows(val):
            features = self.size_node(val.shape[-1])
            shape = [self.size_node(self.rows[0]), self.size_node(self.rows[1]), features]
            source = self.graph.call_function(aten.expand.default, (node, shape))
        flat = self.graph.call_function(aten.reshape.default, (source, [-1, self.size_node(val.shape[-1])]))
        return self.graph.call_function(aten.index_select.default, (flat, 0, self.index))

    def embed_real_tokens(self) -> torch.fx.Node:
        """The embedding looked up for the real tokens' ids only (gathered first): its gradient then
        adds those rows into the table, not the pads' zero rows as well (one element at a time:
        ``passes/scatter_nd_accumulation.py``), and no dense gradient is scattered back first."""
        assert self.index is not None
        flat_ids = self.graph.call_function(aten.reshape.default, (self.ids, [-1]))
        real_ids = self.graph.call_function(aten.index_select.default, (flat_ids, 0, self.index))
        arguments = (self.embedding.args[0], real_ids, *self.embedding.args[2:])
        return self.graph.call_function(aten.embedding.default, arguments, dict(self.embedding.kwargs))

    def repad(self, node: torch.fx.Node) -> torch.fx.Node:
        """``node``'s dense layout again: its real-token rows scattered into zeros."""
        if node not in self.repadded:
            val = value(node)
            assert val is not None
            rows = self.sparse[node]
            sizes = [self.size_node(self.flat_rows), self.size_node(val.shape[-1])]
            zeros = self.graph.call_function(aten.new_zeros.default, (rows, sizes))
            filled = self.graph.call_function(aten.index_copy.default, (zeros, 0, self.index, rows))
            shape = [self.size_node(s) for s in val.shape]
            dense = self.graph.call_function(aten.view.default, (filled, shape))
            self.repadded[node] = dense
            self.vals[dense] = val
            self.layout[dense] = of_rows(val)
        return self.repadded[node]

    def _val(self, node: Any) -> Any:
        if node in self.vals:
            return self.vals[node]
        return node.meta.get("val") if isinstance(node, torch.fx.Node) else None

    def in_rows(self, node: torch.fx.Node) -> bool:
        """A dense value whose rows are this stream's tokens in (b, t) order, learnt from data flow."""
        tags = self.layout.get(node)
        val = value(node)
        return tags is not None and val is not None and self.has_rows(val) and leading_is_rows(tags)

    def fits(self, node: torch.fx.Node) -> bool:
        """A dense operand of a row-wise op on this stream's rows that may be gathered at its index:
        one this stream does not reach (a bias, position embeddings), or one that it reaches whose
        row dims (or the dims it broadcasts along, size 1) are the stream's own."""
        if node in self.foreign:
            return False
        tags = self.layout.get(node)
        val = value(node)
        if tags is None or val is None or val.dim() <= 1:
            return True
        if self.has_rows(val):
            return leading_is_rows(tags)
        if val.dim() not in (2, 3):
            return False
        wanted = ("b", "t")[-(val.dim() - 1) :]  # a [seq, C] operand broadcasts along the batch
        return all(
            tag == want or expr(size) == 1
            for tag, want, size in zip(tags[:-1], wanted, val.shape[:-1], strict=True)
        )

    def _mark_foreign(self, order: list[torch.fx.Node]) -> None:
        on_grid = {self.ids}
        for node in order:
            if self._keeps_grid(node, on_grid):
                on_grid.add(node)
            other_stream = (
                node.op == "call_function"
                and node.target is aten.embedding.default
                and node is not self.embedding
                and _padding_idx(node) >= 0
                and node.args[1] not in on_grid
            )
            if other_stream or any(i in self.foreign for i in node.all_input_nodes):
                self.foreign.add(node)

    def _keeps_grid(self, node: torch.fx.Node, on_grid: set[torch.fx.Node]) -> bool:
        """``node`` is a ``[batch, seq]`` tensor computed from this stream's ids position by position
        (RoBERTa's position ids: ``ne``, ``cumsum`` along the sequence, ``mul``, ``add``, casts), so
        an embedding looked up with it has token (b, t)'s row at (b, t): this stream's grid, not
        another padded stream's. Other operands may only be numbers or broadcast over the batch
        (``[seq]``, ``[1, seq]``)."""
        if node.op != "call_function" or node.target not in _GRID_KEEPING:
            return False
        out = value(node)
        if out is None or out.dim() != 2:
            return False
        if not all(_same(expr(a), b) for a, b in zip(out.shape, self.rows, strict=True)):
            return False
        dim = node.args[1] if len(node.args) > 1 else None
        if node.target is aten.cumsum.default and not (isinstance(dim, int) and dim % 2 == 1):
            return False  # a running sum over the batch: position (b, t) then depends on other rows' tokens
        reads_ids = False
        for arg in node.all_input_nodes:
            if arg in on_grid:
                reads_ids = True
                continue
            val = value(arg)
            if arg in self.foreign or val is None or val.dim() > 2:
                return False
            sizes = [expr(s) for s in val.shape]
            if val.dim() == 2 and sizes[0] != 1:
                return False  # a [batch, seq] tensor of its own: another stream's ids, say
            if val.dim() > 0 and not (sizes[-1] == 1 or _same(sizes[-1], self.rows[1])):
                return False
        return reads_ids

    # ---- the walk --------------------------------------------------------------------------
    def run(self) -> int:
        graph = self.graph
        order = list(graph.nodes)
        following = order[order.index(self.embedding) + 1]
        self._mark_foreign(order)
        with graph.inserting_before(following):
            positions = graph.call_function(aten.nonzero.default, (self.ids,))  # its mask comes last
            self.index = graph.call_function(aten.view.default, (positions, [-1]))
            self.sparse[self.embedding] = self.embed_real_tokens()
        for node in order[order.index(self.embedding) + 1 :]:
            if node.op == "placeholder":
                continue
            with graph.inserting_before(node):
                if node.op != "output" and self._make_sparse(node):
                    continue
                self._note_read_position(node)
                self._feed_dense(node)
        with graph.inserting_before(positions):
            positions.args = (self._kept_mask(),)
        return len(self.sparse) - 1

    def moved_heavy(self) -> bool:
        """A linear or matmul runs on real tokens: where only cheap ops right after the embedding do
        (the next layer re-pads), the zero fill and index_copy cost more than they save."""
        return any(node.target in _HEAVY for node in self.sparse)

    def _kept_mask(self) -> torch.fx.Node:
        """The flat ``[batch * seq]`` mask of the tokens the sparse rows hold: the real ones, every
        position of a row that is all padding, each pad right before a real token, a row's leading
        pads, and the sequence positions a select reads."""
        graph = self.graph
        real = graph.call_function(aten.ne.Scalar, (self.ids, self.pad))
        some_real = graph.call_function(aten.any.dim, (real, 1, True))
        all_padding = graph.call_function(aten.logical_not.default, (some_real,))
        kept = graph.call_function(aten.logical_or.default, (real, all_padding))
        # The pad right before a real token: a causal LM that shifts its labels inside reads that
        # position's output for the token's label (wave 42: a hole of pads in a row made the
        # token after it be scored on the re-padded zeros, loss and gradients off).
        following = graph.call_function(aten.slice.Tensor, (real, 1, 1, _TO_THE_END))
        first = graph.call_function(aten.select.int, (real, 1, 0))
        none = graph.call_function(aten.zeros_like.default, (first,))
        beyond = graph.call_function(aten.unsqueeze.default, (none, 1))
        next_real = graph.call_function(aten.cat.default, ([following, beyond], 1))
        kept = graph.call_function(aten.logical_or.default, (kept, next_real))
        # And a row's leading pads with it: the last of them has no real key to attend to, and
        # an attention that then averages over the masked keys reads the pads before it (a
        # left-padded OPT with eager attention: still 54 % off with the last pad alone).
        seen = graph.call_function(aten.cumsum.default, (real, 1))
        leading = graph.call_function(aten.eq.Scalar, (seen, 0))
        kept = graph.call_function(aten.logical_or.default, (kept, leading))
        for position in sorted(set(self.read_positions)):
            column = graph.call_function(aten.select.int, (kept, 1, position))
            every_row = graph.call_function(aten.ones_like.default, (column,))
            kept = graph.call_function(aten.select_scatter.default, (kept, every_row, 1, position))
        return graph.call_function(aten.reshape.default, (kept, [-1]))

    def _note_read_position(self, node: torch.fx.Node) -> None:
        """A select of one sequence position of a [batch, seq, features] tensor that is re-padded,
        or a slice of a few leading or trailing positions (``h[:, :1]``, ``h[:, -1:]``: the same reads
        written as slices; until wave 41 they read the re-padded zeros where a row has a pad)."""
        if node.target not in (aten.select.int, aten.slice.Tensor) or node.args[0] not in self.sparse:
            return
        val = value(node.args[0])
        dim = node.args[1] if len(node.args) > 1 else 0
        if (
            val is None
            or val.dim() != 3
            or not isinstance(dim, int)
            or dim % 3 != 1
            or not self.has_rows(val)
        ):
            return
        if node.target is aten.select.int:
            if isinstance(node.args[2], int):
                self.read_positions.append(node.args[2])
            return
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        start = 0 if start is None else start
        if not (isinstance(start, int) and isinstance(end, int) and isinstance(step, int)):
            return
        if start < 0 and end >= _TO_THE_END:  # ``h[:, -1:]``: the last positions, counted from the end
            end = 0
        positions = range(start, end, step)
        if (start >= 0 or end <= 0) and 0 < len(positions) <= _POSITIONS_READ_AT_MOST:
            self.read_positions.extend(positions)

    def _make_sparse(self, node: torch.fx.Node) -> bool:
        positions = row_arguments(node, self.has_rows, leading_reshapes=True, broadcasts=self.broadcasts)
        if positions is None:
            return False
        row_args = [node.args[p] for p in positions if p < len(node.args)]
        row_args = [a for a in row_args if isinstance(a, torch.fx.Node)]
        reads_sparse = any(a in self.sparse for a in row_args)
        heavy_after_repad = node.target in _HEAVY and any(self.in_rows(a) for a in row_args)
        if not (reads_sparse or heavy_after_repad):
            return False
        if not all(a in self.sparse or self.fits(a) for a in row_args):
            return False  # rows that are not this stream's (b, t) tokens: the op stays dense
        args = list(node.args)
        for p in positions:
            arg = args[p] if p < len(args) else None
            val = value(arg)
            if val is None:
                continue
            assert isinstance(arg, torch.fx.Node)
            if arg in self.sparse:
                args[p] = self.sparse[arg]
            elif val.dim() > 1:
                args[p] = self.gather(arg)
        if is_leading_reshape(node) or is_full_slice(node):
            self.sparse[node] = args[0]  # rows are rows, whatever the leading layout
            return True
        if node.target in LAST_DIM_ARG:
            position = LAST_DIM_ARG[node.target]
            args[position] = [-1] if isinstance(args[position], (list, tuple)) else -1
        self.sparse[node] = self.graph.call_function(node.target, tuple(args), dict(node.kwargs))
        return True

    def _feed_dense(self, node: torch.fx.Node) -> None:
        reads_repadded = False

        def convert(arg: torch.fx.Node) -> torch.fx.Node:
            nonlocal reads_repadded
            if arg in self.sparse:
                reads_repadded = True
                return self.repad(arg)
            if arg in self.layout:
                reads_repadded = True
            return arg

        node.args = map_arg(node.args, convert)
        node.kwargs = map_arg(node.kwargs, convert)
        if reads_repadded and node.op != "output":
            tags = propagate(node, self.layout.get, self._val, self.rows)
            self.layout[node] = tuple(None for _ in tags) if node in self.foreign else tags


def eliminate_padding(gm: torch.fx.GraphModule) -> list[str]:
    """Run token-wise layers on real tokens only, after the first embedding with a padding_idx."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        padding_idx = _padding_idx(node)
        ids, ids_val, out = node.args[1], value(node.args[1]), value(node)
        if padding_idx < 0 or ids_val is None or out is None:
            continue
        if ids_val.dim() != 2 or out.dim() != 3:
            logger.info("padding elimination: %s skipped (indices are not [batch, seq])", node.name)
            continue
        assert isinstance(ids, torch.fx.Node)
        snapshot = _copy_graph(gm)
        try:
            eliminator = _Eliminator(graph, node, ids, padding_idx)
            moved = eliminator.run()
        except _CannotExpress as error:
            gm.graph = snapshot
            logger.info("padding elimination skipped: size %s has no source among the indices' sizes", error)
            return []
        if moved == 0:
            gm.graph = snapshot
            logger.info(
                "padding elimination: %s skipped (no token-wise op reads its rows in (batch, seq) order)",
                node.name,
            )
            return []
        if not eliminator.moved_heavy():
            gm.graph = snapshot
            logger.info(
                "padding elimination: %s skipped (the %d token-wise ops that could run on real tokens "
                "include no linear or matmul: gathering and re-padding them would cost more than it saves)",
                node.name,
                moved,
            )
            return []
        graph.eliminate_dead_code()
        change = f"padding elimination: {moved} token-wise ops after {node.name} run on real tokens only"
        if eliminator.read_positions:
            kept = ", ".join(str(p) for p in sorted(set(eliminator.read_positions)))
            change += f" (position {kept} kept: a select reads it)"
        logger.info("%s", change)
        return [change]
    return []


def _padding_idx(embedding: torch.fx.Node) -> int:
    """An ``aten.embedding``'s padding_idx, -1 where it has none."""
    padding_idx = embedding.args[2] if len(embedding.args) > 2 else embedding.kwargs.get("padding_idx", -1)
    return padding_idx if isinstance(padding_idx, int) else -1


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    # deepcopy keeps the graph's code generator (a traced forward takes its flat inputs through
    # it): a bare graph_copy lost it, and a graph put back failed the capture with "forward()
    # missing N required positional arguments".
    # Copying the code generator's input spec trips torch's own LeafSpec deprecation warning
    # (torch 2.10+), which says nothing to the user.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(gm.graph)
