"""No zeros gradient for an output the loss does not use.

A model that returns its logits beside its loss gets, from AOTAutograd's ``autograd.Function``, a
materialized zeros tensor as the logits' gradient when training uses the loss alone (autograd
fills each undefined gradient of a Function's outputs with zeros): (batch x seq) x vocab floats
that the backward graph then adds to the logits' real gradient, and that eager PyTorch never
makes. After each forward the Function's node is told not to materialize them, so the backward
graph gets ``None`` for such a tangent; the plan runner (:mod:`ortrain.runtime.graph_executor`)
then runs the region that reads it (or the whole graph) as a variant that computes nothing the
missing gradient makes zero (:func:`without_inputs`), with zeros made only where something else
reads them. Where no variant can be built it feeds zeros of this call's size: a symbolic (dynamic)
size takes its value from the graph's other inputs.

Not computing is also what keeps the gradients right, not only lean: eager never runs the unused
output's backward, while a zero fed through it meets that output's local derivative, and where the
derivative is infinite (the log of a probability that underflowed to 0, sqrt/rsqrt/1/x of 0, an
exp that overflowed) 0 * inf = NaN reached every parameter upstream (wave 53's review).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

aten = torch.ops.aten

# The autograd node AOTAutograd's Function leaves on its outputs.
_FUNCTION_NODE = "CompiledFunctionBackward"
_RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
_ADDS = frozenset({aten.add.Tensor})

# Ops whose output is all zeros when the argument at one of these positions is (``_ANY``: any
# tensor argument). The missing gradient is exactly what eager never computes: it runs no backward
# for an output the loss does not use, so a zero here is eager's answer, not an approximation (no
# 0 * inf to keep). Left out: ops that add something to a zero argument (addmm's bias), and ops
# with several outputs. Measured on the tiny GPT returning its logits beside its loss (batch 8,
# sequence 128): the zero logits gradient went through the head's two matmuls, 8.4 GFLOP a step,
# 312-329 ms a step against 259-261 for the same model returning its loss alone.
_ANY = (-1,)
_ZERO_IN_ZERO_OUT: dict[Any, tuple[int, ...]] = {
    **dict.fromkeys((aten.mm.default, aten.bmm.default, aten.mul.Tensor), _ANY),
    **dict.fromkeys(
        (
            aten.t.default,
            aten.transpose.int,
            aten.permute.default,
            aten.expand.default,
            aten.clone.default,
            aten.alias.default,
            aten.neg.default,
            aten.mul.Scalar,
            aten.div.Scalar,
            aten.div.Tensor,
            aten.sum.default,
            aten.sum.dim_IntList,
            aten.mean.dim,
            aten.slice.Tensor,
            aten.select.int,
            aten.squeeze.dim,
            aten.squeeze.dims,
            aten.unsqueeze.default,
            aten._to_copy.default,
            aten.index_select.default,
            aten.gather.default,
            aten.embedding_dense_backward.default,
            aten.gelu_backward.default,
            aten.threshold_backward.default,
            aten.tanh_backward.default,
            aten.sigmoid_backward.default,
            aten._softmax_backward_data.default,
            *_RESHAPES,
        ),
        (0,),
    ),
}


# Ops whose value does not depend on their tensor arguments' values, only on their sizes: a zero
# argument neither makes them zero nor carries a gradient through them.
_VALUE_FREE = frozenset(
    {
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.empty_like.default,
        aten.full_like.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_empty.default,
        aten.new_full.default,
        aten.new_empty_strided.default,
        aten.sym_size.int,
        aten.sym_stride.int,
        aten.sym_numel.default,
        aten.sym_storage_offset.default,
    }
)


def is_tangent(placeholder: torch.fx.Node) -> bool:
    """AOTAutograd names the backward graph's inputs for output gradients ``tangents_<n>``."""
    return placeholder.op == "placeholder" and placeholder.name.startswith("tangents")


def leave_unused_tangents_none(outputs: Any) -> type | None:
    """Ask the Function behind ``outputs`` for ``None`` where an output gets no gradient; returns
    that ``autograd.Function`` class (None when no output has one)."""
    for output in outputs if isinstance(outputs, list | tuple) else (outputs,):
        node = getattr(output, "grad_fn", None)
        if node is not None and type(node).__name__ == _FUNCTION_NODE:
            node.set_materialize_grads(False)
            return node._forward_cls
    return None


def has_size_symbols(placeholders: list[torch.fx.Node]) -> bool:
    """Whether a graph input has a symbolic size (or is one): a dynamic capture's graphs."""
    values = [p.meta.get("val") for p in placeholders]
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not _fixed(v)) for v in values)


def size_symbols(placeholders: list[torch.fx.Node], args: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """This call's value of each size symbol that a graph input has as a dim (or is)."""
    symbols: dict[sympy.Symbol, int] = {}
    for placeholder, arg in zip(placeholders, args, strict=True):
        value = placeholder.meta.get("val")
        if isinstance(value, torch.SymInt) and isinstance(arg, int):
            symbols.setdefault(value.node.expr, arg)
        elif isinstance(value, torch.Tensor) and isinstance(arg, torch.Tensor):
            for size, actual in zip(value.shape, arg.shape, strict=True):
                if isinstance(size, torch.SymInt):
                    symbols.setdefault(size.node.expr, actual)
    return symbols


def zeros_like_value(value: torch.Tensor, symbols: dict[sympy.Symbol, int] | None = None) -> torch.Tensor:
    """Zeros of a captured fake value; its symbolic sizes take this call's ``symbols``."""
    known = {symbol: sympy.Integer(size) for symbol, size in (symbols or {}).items()}
    sizes = []
    for size in value.shape:
        if isinstance(size, torch.SymInt):
            resolved = sympy.sympify(size.node.expr).xreplace(known)
            if not resolved.is_Integer:
                raise RuntimeError(
                    f"no size for a zero gradient of shape {tuple(value.shape)}: {resolved} unknown"
                )
            size = int(resolved)
        sizes.append(size)
    return torch.zeros(sizes, dtype=value.dtype, device=value.device)


def carried_outputs(region: torch.fx.GraphModule, carriers: set[int]) -> set[int]:
    """Positions of ``region``'s outputs that depend on its placeholders at ``carriers`` (values
    that may hold an output gradient), other than through their sizes alone."""
    placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
    carrying = {placeholders[p] for p in carriers}
    for node in region.graph.nodes:
        if node.op == "call_function" and node.target not in _VALUE_FREE:
            if any(a in carrying for a in node.all_input_nodes):
                carrying.add(node)
    returned = region.graph.output_node().args[0]
    returned = returned if isinstance(returned, (tuple, list)) else (returned,)
    return {i for i, r in enumerate(returned) if r in carrying}


def without_inputs(
    region: torch.fx.GraphModule, positions: set[int], carriers: set[int] | None = None
) -> torch.fx.GraphModule | None:
    """``region`` without its placeholders at ``positions`` (zero): what they make zero is not
    computed and additions of zeros are dropped; None when one of them must exist (something that
    is not zero reads it) and its size is not fixed. Outputs that come out zero are removed; their
    positions are in ``meta["zero_outputs"]``.

    ``carriers``: the other placeholders that may hold an output gradient (None: all of them). A
    backward graph is linear in its output gradients, so a value computed from the missing ones and
    from no gradient that is there is a contribution of the missing ones alone: zero, whatever the
    operator (eager never computes it). Computing it from zeros instead gave 0 * inf = NaN where the
    unused output's derivative is infinite.

    A zero value is made (as a zeros constant) only where something that is not itself zero reads
    it. Values of a data-dependent size (the rows a sparsity pass gathered) cannot be made that
    way: where one must exist it is computed as captured, from zeros made further up.
    """
    graph = torch.fx.Graph()
    mapping = graph.graph_copy(region.graph, {})
    graph.output(mapping)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    zeros = {placeholders[p] for p in positions}
    others = set(range(len(placeholders))) - set(positions) if carriers is None else carriers - set(positions)
    equal_to = _zero_propagation(graph, zeros, {placeholders[p] for p in others})
    # Zeros that something other than a zero or a dropped addition reads must exist.
    needed: set[torch.fx.Node] = set()
    # A zero output leaves as None, and whoever reads it may have to make it: not one of a
    # data-dependent size, which nothing outside this graph can know. Those are computed.
    returned = list(graph.output_node().args[0])  # type: ignore[arg-type]
    pending = [
        z for z in zeros if any(u not in zeros and u not in equal_to and u.op != "output" for u in z.users)
    ] + [r for r in returned if r in zeros and _data_dependent(r.meta.get("val"))]
    while pending:
        node = pending.pop()
        if node in needed:
            continue
        needed.add(node)
        if not _fixed(node.meta.get("val")):  # computed as captured: its zero arguments must exist
            pending += [a for a in node.all_input_nodes if a in zeros]
    if any(n.op == "placeholder" and not _fixed(n.meta.get("val")) for n in needed):
        return None  # a zero whose size only this call knows must exist: the caller feeds it
    # Placeholders first: their zeros go before the first computation, which may be replaced later.
    first_computation = next(n for n in graph.nodes if n.op != "placeholder")
    for node in sorted(needed, key=lambda n: n.op != "placeholder"):
        if _fixed(node.meta.get("val")):
            with graph.inserting_before(first_computation if node.op == "placeholder" else node):
                made = _zeros_node(graph, node.meta["val"])
            node.replace_all_uses_with(made)
            graph.erase_node(node)
            zeros.add(made)  # returned too, it still leaves as None
    for addition, kept in equal_to.items():
        addition.replace_all_uses_with(kept)
    # Outputs that are zeros leave the region as None (positions in ``meta["zero_outputs"]``): the
    # regions that read them get variants too, so that a zero gradient crossing regions is not
    # materialized and multiplied there either.
    output = graph.output_node()
    returned = list(output.args[0])  # type: ignore[arg-type]
    zero_outputs = frozenset(i for i, r in enumerate(returned) if r in zeros and r not in needed)
    if zero_outputs:
        output.args = (tuple(r for i, r in enumerate(returned) if i not in zero_outputs),)
    graph.eliminate_dead_code()
    for placeholder in zeros & (set(placeholders) - needed):  # read only by what is gone now
        graph.erase_node(placeholder)
    made = torch.fx.GraphModule(region, graph)
    made.meta["zero_outputs"] = zero_outputs
    return made


def _zero_propagation(
    graph: torch.fx.Graph, zeros: set[torch.fx.Node], carriers: set[torch.fx.Node]
) -> dict[torch.fx.Node, torch.fx.Node]:
    """Add to ``zeros`` every node that is zero because of them: one that ``_ZERO_IN_ZERO_OUT``
    makes zero, or a tensor computed from zeros and from no value that may hold a gradient (not
    one of ``carriers`` nor computed from one). Returns the additions of a zero to another value of
    the same size and dtype, each with the value it equals."""
    equal_to: dict[torch.fx.Node, torch.fx.Node] = {}
    carrying = set(carriers)
    for node in graph.nodes:
        if node.op != "call_function" or node.target in _VALUE_FREE:
            continue
        inputs = node.all_input_nodes
        carried = any(a in carrying for a in inputs)
        if carried:
            carrying.add(node)
        if _zero_when_zero(node, zeros) or (
            not carried and any(a in zeros for a in inputs) and _tensors(node.meta.get("val"))
        ):
            zeros.add(node)
            carrying.discard(node)
        elif node.target in _ADDS and not node.kwargs:
            a, b = (equal_to.get(x, x) for x in node.args)
            kept = b if a in zeros else a if b in zeros else None
            if isinstance(kept, torch.fx.Node) and _same_layout(kept.meta.get("val"), node.meta.get("val")):
                if kept in zeros:
                    zeros.add(node)
                else:
                    equal_to[node] = kept
    return equal_to


def _tensors(value: Any) -> bool:
    """A tensor, or the tuple of tensors of an operator with several outputs."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(v is None or isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def _data_dependent(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and bool(free_unbacked_symbols(value))


def _fixed(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape)


def _same_layout(a: Any, b: Any) -> bool:
    """Same dtype and sizes; a data-dependent size is the same only when it is provably so (asking
    the symbols would raise)."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.dim() == b.dim()
        and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True))
    )


def _zero_when_zero(node: torch.fx.Node, zeros: set[torch.fx.Node]) -> bool:
    """Whether ``node``'s output is zero because of its zero arguments (see ``_ZERO_IN_ZERO_OUT``)."""
    positions = _ZERO_IN_ZERO_OUT.get(node.target)
    if positions is None:
        return False
    if positions == _ANY:
        positions = range(len(node.args))
    return any(p < len(node.args) and node.args[p] in zeros for p in positions)


def _zeros_node(graph: torch.fx.Graph, value: torch.Tensor) -> torch.fx.Node:
    node = graph.call_function(
        aten.zeros.default, ([int(s) for s in value.shape],), {"dtype": value.dtype, "device": value.device}
    )
    node.meta["val"] = value  # the same size and dtype: what the exporter reads
    return node


def with_zero_tangents(graph: torch.fx.GraphModule, args: list[Any]) -> list[Any]:
    """``args`` with zeros where a tangent of ``graph`` is None (a graph run as it was captured)."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    symbols = size_symbols(placeholders, args)
    return [
        zeros_like_value(p.meta["val"], symbols) if a is None and is_tangent(p) else a
        for p, a in zip(placeholders, args, strict=True)
    ]


class UnreachedGradients:
    """The gradients a backward graph returns that only unused outputs' gradients reach.

    Eager PyTorch leaves ``.grad`` None on a parameter whose only path to the loss is an output
    the loss does not use (an auxiliary head returned beside the main one): autograd never reaches
    it. The captured backward returns a gradient for every input that requires grad, and with the
    unused tangents None it made zeros there; a zero gradient is not None to an optimizer (AdamW
    still decays the weight and moves it by its momentum). A backward graph is linear in its
    tangents, so an output that depends on none but missing ones is zero, and None is eager's answer.
    """

    def __init__(self, graph: torch.fx.GraphModule) -> None:
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        self.tangents = frozenset(i for i, p in enumerate(placeholders) if is_tangent(p))
        reached: dict[torch.fx.Node, frozenset[int]] = {
            p: frozenset({i}) if i in self.tangents else frozenset() for i, p in enumerate(placeholders)
        }
        outputs: list[Any] = []
        for node in graph.graph.nodes:
            if node.op == "output":
                outputs = list(node.args[0]) if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            elif node.op != "placeholder":
                reached[node] = frozenset().union(*(reached[a] for a in node.all_input_nodes))
        # Per output, the tangents it depends on; empty where none (left as computed).
        self.per_output = [
            reached.get(o, frozenset()) if isinstance(o, torch.fx.Node) else frozenset() for o in outputs
        ]

    def missing(self, args: Sequence[Any]) -> frozenset[int]:
        return frozenset(i for i in self.tangents if i < len(args) and args[i] is None)

    def set_none(self, outputs: Any, missing: frozenset[int]) -> Any:
        """``outputs`` with None for each gradient that only the ``missing`` tangents reach."""
        if not missing or not isinstance(outputs, (list, tuple)) or len(outputs) != len(self.per_output):
            return outputs
        unreached = [j for j, needed in enumerate(self.per_output) if needed and needed <= missing]
        if not unreached:
            return outputs
        result = list(outputs)
        for j in unreached:
            result[j] = None
        return type(outputs)(result) if isinstance(outputs, tuple) else result
