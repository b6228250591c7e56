"""Export one AOTAutograd FX graph to an ONNX model that ONNX Runtime can run.

The graph's outputs are not all computations: some are the graph's own inputs (saved for
backward), some repeat another output, some are ``None`` (no gradient) and some are sizes
(SymInts, with dynamic shapes). Only the distinct computed tensors become ONNX outputs; the rest
is described by :class:`OutputSource` so the executor rebuilds them without copying anything.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import onnx
import onnx_ir
import sympy
import torch
from torch._guards import detect_fake_mode
from torch.export import Dim

from ortrain.capture.lazy_recompile import compile_now, deep_copy
from ortrain.capture.memory_layouts import dense_dim_order, shares_storage, size_hint
from ortrain.capture.number_inputs import numbers_as_tensors
from ortrain.capture.size_carriers import carry_free_sizes
from ortrain.capture.symbol_ranges import symbol_range
from ortrain.capture.symbolic_sizes import (
    SizeCeil,
    SizeCeilDiv,
    SizeFloor,
    SizeFloorDiv,
    SizeMax,
    SizeMin,
    SizeMod,
    SizePythonMod,
    SizeTrueDiv,
)
from ortrain.capture.view_ops import RELAYOUTS, RESHAPES, views_as_reshapes
from ortrain.export import direct_translation
from ortrain.export.double_precision_constants import (
    all_floats_double,
    numbers_as_operands,
    python_floats_as_double,
)
from ortrain.export.double_precision_infinity_checks import infinity_checks_in_double
from ortrain.export.double_precision_sizes import sizes_as_double
from ortrain.export.exporter_decompositions import lean_decomposition
from ortrain.export.factory_dtypes import spell_out_factory_dtypes
from ortrain.export.flash_attention_math import NoMathForm
from ortrain.export.half_precision_numbers import size_numbers_in_float32
from ortrain.export.index_dtypes import cast_indices_to_int64, int64_advanced_indices
from ortrain.export.integer_sums import sum_integers_exactly
from ortrain.export.known_shape_inference import shape_inference_only_where_unknown
from ortrain.export.nan_propagation import propagate_nan
from ortrain.export.negative_indices import refuse_negative_indices
from ortrain.export.number_operands import tensors_for_number_operands
from ortrain.export.onnx_translations import reused_op_registry
from ortrain.export.op_signatures import op_signatures_shared
from ortrain.export.output_size_hints import drop_output_size_hints
from ortrain.export.rewrite_rules_by_root import rewrite_rules_tried_by_root_operator
from ortrain.export.rounded_number_operands import round_number_operands
from ortrain.export.size_floor_division import exact_floor_divisions
from ortrain.export.slice_backward_copies import copy_slice_backwards
from ortrain.export.spelled_out_math import call_with_value, spell_out_math
from ortrain.export.zero_dim_reductions import reduce_zero_dim_as_vectors

logger = logging.getLogger("ortrain.export")

# Whether graphs are translated node by node before trying torch.onnx.export (tests turn it off
# to compare both paths), and how many graphs took each path in this process.
DIRECT_TRANSLATION = True
TRANSLATIONS: Counter[str] = Counter()

_HINT_CANDIDATES = [17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97]


@dataclass(frozen=True)
class OutputSource:
    """Where one graph output comes from at run time."""

    # "number": a number the graph computes from tensor values (``.item()``), returned by ONNX
    # as a 0-d tensor and handed back as the Python number the FX graph returns.
    kind: Literal["onnx", "input", "same", "none", "size", "view", "strided", "output_size", "number"]
    index: int = -1  # onnx output / graph input / earlier output, by kind
    # For "size": a formula over input sizes and data-dependent sizes (``output_symbol_sources``).
    expr: sympy.Expr | None = None
    # For "view": a reshape of an ONNX output (from_input=False) or of a graph input, to ``shape``.
    from_input: bool = False
    shape: tuple[sympy.Expr, ...] = ()
    # For "output_size": a size known only once the graph ran (a data-dependent, "unbacked" size,
    # such as the number of rows a mask selects), read as dim ``dim`` of onnx output ``index``.
    dim: int = -1
    # For "strided": a view of the output ``index`` (contiguous) with ``shape`` as sizes,
    # ``strides`` and storage ``offset``, formulas over the input sizes (see _strided_view_base).
    strides: tuple[sympy.Expr, ...] = ()
    offset: sympy.Expr | None = None


aten = torch.ops.aten

# Ops whose result views their first argument's elements: reshapes, reorderings, selections.
_STRIDED_VIEWS = RELAYOUTS | {
    aten.select.int,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.diagonal.default,
    aten.unfold.default,
    aten.as_strided.default,
}


def _strided_view_base(
    node: torch.fx.Node, contiguous: dict[torch.fx.Node, int], sources: dict[sympy.Symbol, tuple[int, int]]
) -> tuple[int, tuple[sympy.Expr, ...], tuple[sympy.Expr, ...], sympy.Expr] | None:
    """(the position of the contiguous output ``node`` views, its sizes, strides and storage offset)
    for an output that selects from another output with sizes that change between calls
    (``h, h[:, -1]``; ``h[:, : T // 2]``).

    AOTAutograd remakes such an output from its base after every call. With fixed sizes it replays
    the view; with symbolic ones it takes the base's elements at the strides and offset of the
    tensor the graph returned for it. ONNX Runtime returns a contiguous copy, so the remade view
    read the base at the copy's strides: ``h[:, -1]`` came back as ``h[:, 0]``-like rows of
    other positions, with gradients to match (wave 41). Returned as the view itself, it is
    eager's. The base must be contiguous at offset 0 in the trace, as ONNX Runtime returns it."""
    base = node
    while base.op == "call_function" and base.target in _STRIDED_VIEWS:
        if not isinstance(base.args[0], torch.fx.Node):
            return None
        base = base.args[0]
        if base in contiguous:
            break
    value, base_value = node.meta.get("val"), base.meta.get("val")
    if base is node or base not in contiguous or not isinstance(value, torch.Tensor):
        return None
    if not isinstance(base_value, torch.Tensor):
        return None
    if dense_dim_order(base_value) != tuple(range(base_value.dim())):
        return None
    if size_hint(base_value.storage_offset()) != 0 or not shares_storage(value, base_value):
        return None  # (a reshape along the chain may have copied a non-contiguous input)
    sizes = tuple(_expr(v) for v in value.shape)
    strides = tuple(_expr(v) for v in value.stride())
    offset = _expr(value.storage_offset())
    free = set().union(*(e.free_symbols for e in (*sizes, *strides, offset)))
    if not free or not free <= sources.keys():
        return None  # fixed: AOTAutograd replays the view itself
    return contiguous[base], sizes, strides, offset


def _selects(node: torch.fx.Node) -> bool:
    """Whether ``node`` views its input through a chain holding more than reshapes (``h[:, -1]``,
    ``h[:, -1:].squeeze(1)``, a transpose): a candidate for :func:`_strided_view_base`."""
    while node.op == "call_function" and node.target in _STRIDED_VIEWS:
        if node.target not in RESHAPES:
            return True
        if not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return False


def _reshape_base(node: torch.fx.Node, sources: dict[sympy.Symbol, tuple[int, int]]) -> torch.fx.Node | None:
    """The tensor ``node`` reshapes (through a chain of reshapes), if its size can be rebuilt.

    Such an output is returned as a PyTorch view of its base: as an ONNX output it would be a copy.
    """
    base = node
    while base.op == "call_function" and base.target in RESHAPES and isinstance(base.args[0], torch.fx.Node):
        base = base.args[0]
    if base is node or not isinstance(base.meta.get("val"), torch.Tensor):
        return None
    if any(sym not in sources for size in node.meta["val"].shape for sym in _expr(size).free_symbols):
        return None
    return base


@dataclass
class ExportedGraph:
    model: onnx.ModelProto
    input_positions: list[int]  # for each ONNX input, the graph argument that feeds it
    outputs: list[OutputSource]
    # Each size symbol, and one (argument, dim) where it can be read at run time.
    symbol_sources: dict[sympy.Symbol, tuple[int, int]] = field(default_factory=dict)
    # Data-dependent size symbols a "size" output's formula reads: (onnx output, dim) of each.
    output_symbol_sources: dict[sympy.Symbol, tuple[int, int]] = field(default_factory=dict)
    # Arguments that are numbers no input tensor has as a size: each is passed as the carrier
    # ``empty(0, n)`` (capture/size_carriers.py).
    carried_sizes: list[int] = field(default_factory=list)
    # Arguments that are numbers computed from values (``.item()``), passed as 0-d tensors of
    # these dtypes (capture/number_inputs.py).
    number_inputs: dict[int, torch.dtype] = field(default_factory=dict)


class ExportError(RuntimeError):
    """The graph could not be exported; the message names the operator where it can.

    ``operator`` is the qualified name (``aten._linalg_eigh.default``) of an operator without an
    ONNX translation, when that was the cause.
    """

    def __init__(self, message: str, operator: str | None = None) -> None:
        super().__init__(message)
        self.operator = operator


def _expr(value: Any) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def _symbol_sources(placeholders: list[torch.fx.Node]) -> dict[sympy.Symbol, tuple[int, int]]:
    sources: dict[sympy.Symbol, tuple[int, int]] = {}
    for position, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                expr = _expr(size)
                if isinstance(expr, sympy.Symbol) and expr not in sources:
                    sources[expr] = (position, dim)
    return sources


# Min and Max come from views such as the diagonal of a dynamic, non-square tensor.
_SIZE_OPERATORS: dict[type, Any] = {
    sympy.Mul: operator.mul,
    sympy.Add: operator.add,
    SizeMin: torch.sym_min,
    SizeMax: torch.sym_max,
    SizeFloorDiv: operator.floordiv,
    SizeMod: operator.mod,
    SizePythonMod: operator.mod,
}


def _size_node(
    graph: torch.fx.Graph,
    expr: sympy.Expr,
    sources: dict[sympy.Symbol, tuple[int, int]],
    placeholders: list[torch.fx.Node],
) -> Any:
    """Build FX nodes computing ``expr`` from the sizes of tensor inputs."""
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        if expr not in sources:
            raise ExportError(f"size {expr} is not the size of any input tensor")
        position, dim = sources[expr]
        size = graph.call_function(torch.ops.aten.sym_size.int, (placeholders[position], dim))
        size.meta["val"] = placeholders[position].meta["val"].shape[dim]
        return size
    # Sizes are never negative, so floor and ceiling of their quotients are integer divisions.
    quotient = _integer_quotient(expr)
    if quotient is not None:
        numerator, denominator, ceiling = quotient
        if ceiling:  # ceil(a / b) = (a + b - 1) // b
            numerator = numerator + denominator - 1
        expr = SizeFloorDiv(numerator, denominator, evaluate=False)
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) >= 1:
        # s**2: the flattened (s, s) scores of self-attention (XLM's backward).
        base = _size_node(graph, expr.base, sources, placeholders)
        acc = base
        for _ in range(int(expr.exp) - 1):
            value = _size_value(acc) * _size_value(base)
            acc = graph.call_function(operator.mul, (acc, base))
            acc.meta["val"] = value
        return acc
    op = _SIZE_OPERATORS.get(type(expr))
    if op is not None:
        parts = [_size_node(graph, arg, sources, placeholders) for arg in expr.args]
        acc = parts[0]
        for part in parts[1:]:
            value = op(_size_value(acc), _size_value(part))
            acc = graph.call_function(op, (acc, part))
            acc.meta["val"] = value  # the translator reads every node's value
        return acc
    raise ExportError(f"cannot express size {expr} in ONNX")


def _integer_quotient(expr: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr, bool] | None:
    """``(a, b, ceiling)`` where ``expr`` is ``a // b``, ``ceil(a / b)`` or ``floor(a / b)``."""
    if isinstance(expr, (SizeCeil, SizeFloor)) and isinstance(expr.args[0], SizeTrueDiv):
        numerator, denominator = expr.args[0].args
        return numerator, denominator, isinstance(expr, SizeCeil)
    if isinstance(expr, SizeCeilDiv):
        return expr.args[0], expr.args[1], True
    return None


def _computed_from_values(node: torch.fx.Node, sources: dict[sympy.Symbol, tuple[int, int]]) -> bool:
    """Whether the integer ``node`` reads a symbol no input tensor has as a size, with no output
    tensor to read it off either: a number from ``.item()`` (``loss / mask.sum().item()``) that
    the forward saves for its backward. ONNX computes it; the executor returns it as a number."""
    if node.op == "placeholder":
        return False
    unknown = _expr(node.meta["val"]).free_symbols - sources.keys()
    outputs = list(node.graph.output_node().args[0])
    return any(_tensor_with_size(outputs, symbol) is None for symbol in unknown)


def _size_value(size: Any) -> Any:
    return size.meta["val"] if isinstance(size, torch.fx.Node) else size


def _tensor_with_size(candidates: list[Any], size: sympy.Expr) -> tuple[torch.fx.Node, int] | None:
    """A computed tensor among ``candidates`` with a dim equal to ``size``, and that dim."""
    for node in candidates:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if node is None or node.op == "placeholder" or not isinstance(val, torch.Tensor):
            continue
        for dim, dim_size in enumerate(val.shape):
            if _expr(dim_size) == size:
                return node, dim
    return None


def _free_value(used: set[int], lower: int, upper: int | None) -> int:
    """A value for a size symbol inside its range: one of the small primes if the range allows
    (a reflect pad of 32 needs a length above 32), else an unused value of the range from its top,
    else (a range narrower than the symbols sharing it) its lowest value."""
    lowest = max(lower, 2)
    inside = [c for c in _HINT_CANDIDATES if c >= lowest and (upper is None or c <= upper)]
    # Past the primes: large values, which no fixed size of the graph is likely to equal.
    if upper is None:
        rest: Iterable[int] = itertools.count(max(lowest, _HINT_CANDIDATES[-1] + 1))
    else:
        rest = range(upper, lowest - 1, -1)
    return next((c for c in itertools.chain(inside, rest) if c not in used), lowest)


def _example_inputs(
    placeholders: list[torch.fx.Node],
) -> tuple[list[Any], list[dict[int, Any] | None]]:
    """Real example tensors for torch.export, and the dynamic dims of each.

    Each size symbol gets its own value (never 0 or 1, never another symbol's) so that
    torch.export cannot mistake two independent sizes for one.
    """
    values: dict[sympy.Symbol, int] = {}
    used: set[int] = set()
    for node in placeholders:
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            continue
        for size in val.shape:
            for sym in _expr(size).free_symbols:
                if sym in values:
                    continue
                hint = size.node.hint if isinstance(size, torch.SymInt) and _expr(size) == sym else None
                lower, upper = symbol_range(size, sym)
                fits = hint is not None and hint > 1 and hint >= lower and (upper is None or hint <= upper)
                if not fits or hint in used:
                    hint = _free_value(used, lower, upper)
                values[sym] = int(hint)
                used.add(int(hint))
    examples: list[Any] = []
    dynamic: list[dict[int, Any] | None] = []
    for node in placeholders:
        val = node.meta["val"]
        sizes = [int(_expr(s).subs(values)) for s in val.shape]
        # In the captured layout: a view the graph takes of an input may rely on its strides (the
        # flash attention kernels' outputs are batch x seq x heads x dim in memory).
        if val.layout == torch.strided:
            unknown = set().union(*(_expr(s).free_symbols for s in val.stride())) - values.keys()
            if unknown:
                # ``x.stride(0)`` read as a number by the forward of a dynamic capture: a size of
                # its own, which no input's shape carries (ONNX Runtime's inputs have no strides).
                raise ExportError(
                    f"graph input {node.name} has strides {tuple(val.stride())} that no input size "
                    "determines (the forward reads a stride of an input whose layout changes between "
                    "calls); make the input contiguous before the call, or keep that part in PyTorch"
                )
            strides = [int(_expr(s).subs(values)) for s in val.stride()]
            examples.append(torch.empty_strided(sizes, strides, dtype=val.dtype).zero_())
        else:
            examples.append(torch.zeros(sizes, dtype=val.dtype))
        dims = {d: Dim.AUTO for d, s in enumerate(val.shape) if _expr(s).free_symbols}
        dynamic.append(dims or None)
    return examples, dynamic


def export_graph(gm: torch.fx.GraphModule, *, opset_version: int) -> ExportedGraph:
    gm = deep_copy(gm)
    tensors_for_number_operands(gm)
    numbers = numbers_as_tensors(gm)
    carried = carry_free_sizes(gm)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sources = _symbol_sources(placeholders)
    output_node = graph.output_node()
    raw_outputs = list(output_node.args[0])

    # Sizes passed in as inputs (saved SymInts, in a backward graph) become sym_size of a tensor.
    first_computation = next(n for n in graph.nodes if n.op != "placeholder")
    for node in placeholders:
        if isinstance(node.meta.get("val"), torch.SymInt):
            with graph.inserting_before(first_computation):
                replacement = _size_node(graph, _expr(node.meta["val"]), sources, placeholders)
            node.replace_all_uses_with(replacement)  # type: ignore[arg-type]

    sources_by_node = {n: i for i, n in enumerate(placeholders)}
    outputs: list[OutputSource] = []
    onnx_nodes: list[torch.fx.Node] = []
    onnx_index: dict[torch.fx.Node, int] = {}
    first_seen: dict[torch.fx.Node, int] = {}
    output_symbols: dict[sympy.Symbol, tuple[int, int]] = {}
    # Outputs that come back contiguous (ONNX outputs and reshapes of them), by their first position,
    # and the outputs that select from another tensor, which may be a view of one of them.
    contiguous_outputs: dict[torch.fx.Node, int] = {}
    selections: list[tuple[int, torch.fx.Node, torch.fx.Node | None]] = []

    def onnx_output(node: torch.fx.Node) -> int:
        if node not in onnx_index:
            onnx_index[node] = len(onnx_nodes)
            onnx_nodes.append(node)
        return onnx_index[node]

    def reshaped_or_own(out: torch.fx.Node, base: torch.fx.Node | None, position: int) -> OutputSource:
        """A reshape of an ONNX output or of an input (``base``), or an ONNX output of its own. What
        ONNX Runtime returns is contiguous: a selection from it can be a view (``contiguous_outputs``);
        an input's layout is the caller's, so a reshape of one is not listed there."""
        if base is None:
            contiguous_outputs.setdefault(out, position)
            return OutputSource("onnx", index=onnx_output(out))
        shape = tuple(_expr(size) for size in out.meta["val"].shape)
        if base.op == "placeholder":
            return OutputSource("view", index=sources_by_node[base], from_input=True, shape=shape)
        contiguous_outputs.setdefault(out, position)
        return OutputSource("view", index=onnx_output(base), shape=shape)

    for position, out in enumerate(raw_outputs):
        if out is None:
            outputs.append(OutputSource("none"))
            continue
        if isinstance(out, int) and not isinstance(out, bool):
            # A size TorchDynamo's graph returns as the number it was specialized to (Funnel's
            # ``seq_len``): handed back as that number (wave 42: refused, the region in PyTorch).
            outputs.append(OutputSource("size", expr=sympy.Integer(out)))
            continue
        if not isinstance(out, torch.fx.Node):
            raise ExportError(f"graph output {position} is a constant {out!r}, which ortrain does not expect")
        if isinstance(out.meta.get("val"), (torch.SymFloat, torch.SymBool)) or (
            isinstance(out.meta.get("val"), torch.SymInt) and _computed_from_values(out, sources)
        ):
            if isinstance(out.meta["val"], torch.SymFloat) and all_floats_double(gm):
                # A float64 model's number (a scale ``1 / n`` saved for the backward): as a float64
                # tensor, which double_precision_sizes computes in float64, not in float32.
                with graph.inserting_before(output_node):
                    out = call_with_value(
                        graph, aten.scalar_tensor.default, (out,), {"dtype": torch.float64},
                        fake_mode=detect_fake_mode([n.meta.get("val") for n in placeholders]),
                    )  # fmt: skip
            outputs.append(OutputSource("number", index=onnx_output(out)))
            continue
        if isinstance(out.meta.get("val"), torch.SymInt):
            size = _expr(out.meta["val"])
            carrier = None if size.free_symbols <= sources.keys() else _tensor_with_size(raw_outputs, size)
            if carrier is not None:
                outputs.append(OutputSource("output_size", index=onnx_output(carrier[0]), dim=carrier[1]))
                continue
            # A formula over data-dependent sizes (``128 - u2``, saved for a backward): each such
            # symbol is read off an output tensor that has it as a dim.
            for symbol in sorted(size.free_symbols - sources.keys() - output_symbols.keys(), key=str):
                carrier = _tensor_with_size(raw_outputs, symbol)
                if carrier is None:
                    raise ExportError(
                        f"graph output {position} is the size {size}, and no input or output tensor "
                        f"has {symbol} as a dim"
                    )
                output_symbols[symbol] = (onnx_output(carrier[0]), carrier[1])
            outputs.append(OutputSource("size", expr=size))
            continue
        if out in first_seen:
            outputs.append(OutputSource("same", index=first_seen[out]))
            continue
        first_seen[out] = position
        base = _reshape_base(out, sources)
        if out.op == "placeholder":
            outputs.append(OutputSource("input", index=sources_by_node[out]))
        elif _selects(out):
            outputs.append(OutputSource("none"))  # decided below, once every contiguous output is known
            selections.append((position, out, base))
        else:
            outputs.append(reshaped_or_own(out, base, position))
    for position, out, base in selections:
        strided = _strided_view_base(out, contiguous_outputs, sources)
        if strided is None:
            outputs[position] = reshaped_or_own(out, base, position)
        else:
            index, sizes, strides, offset = strided
            source = OutputSource("strided", index=index, shape=sizes, strides=strides, offset=offset)
            outputs[position] = source
    output_node.args = (tuple(onnx_nodes),)
    for node in placeholders:
        if isinstance(node.meta.get("val"), torch.SymInt):
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()

    kept = [n for n in graph.nodes if n.op == "placeholder"]
    for node in kept:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"graph input {node.name} is not a tensor ({type(value).__name__})")
    if not onnx_nodes:
        return ExportedGraph(
            onnx.ModelProto(), [], outputs, sources, carried_sizes=carried, number_inputs=numbers
        )
    ir_model = _translate(gm, kept, opset_version=opset_version)
    cast = cast_indices_to_int64(ir_model)
    if cast:
        logger.debug("cast %d int32 index inputs to int64", cast)
    model = onnx_ir.serde.serialize_model(ir_model)
    name_to_position = {n.name: sources_by_node[n] for n in kept}
    onnx_names = [i.name for i in model.graph.input]
    if all(name in name_to_position for name in onnx_names):
        input_positions = [name_to_position[name] for name in onnx_names]
    elif len(onnx_names) == len(kept):
        # The exporter renames an input that is also returned as is (``max`` of a 0-d tensor
        # along dim 0, say) but keeps the placeholders' order.
        input_positions = [sources_by_node[n] for n in kept]
    else:
        missing = next(name for name in onnx_names if name not in name_to_position)
        raise ExportError(f"exported graph has an input {missing!r} that matches no FX placeholder")
    return ExportedGraph(model, input_positions, outputs, sources, output_symbols, carried, numbers)


def _translate(
    gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], *, opset_version: int
) -> onnx_ir.Model:
    """The ONNX model of ``gm``: translated node by node where it can be (see
    :mod:`ortrain.export.direct_translation`), else through ``torch.onnx.export``."""
    spell_out_factory_dtypes(gm)  # for both paths: each translates a factory without one as float32
    # ONNX has no strides: a view is a Reshape. The exports re-trace the graph, where a view's fake
    # input can carry other strides than at capture (an attention kernel's output, transposed
    # back, at a new size: "Cannot view a tensor with shape [s20, 9, 4, 8]", wave 43).
    if views_as_reshapes(gm.graph):
        gm.recompile()
    refuse_negative_indices(gm)  # both translate gathers and scatters that count negatives from the end
    int64_advanced_indices(gm)  # onnxscript's index/index_put combine index dtypes (see index_dtypes)
    drop_output_size_hints(gm)  # onnxscript refuses repeat_interleave's output_size (see the module)
    round_number_operands(gm)  # `x_bf16 >= 1000.3` compares with 1000, as PyTorch (see the module)
    spell_out_math(gm)  # the operators whose translations lose PyTorch's answers (see the module)
    sum_integers_exactly(gm)  # ONNX Runtime's ReduceSum adds integers in double (see the module)
    copy_slice_backwards(gm)  # a slice's backward as a Pad, not a scatter between two transposes
    numbers_as_operands(gm)  # float64 graphs: no float32 attributes (double_precision_constants)
    sizes_as_double(gm)  # numbers computed from sizes in float64, as Python does (double_precision_sizes)
    size_numbers_in_float32(gm)  # half precision times a size's number: float32 (half_precision_numbers)
    reduce_zero_dim_as_vectors(gm)  # ONNX refuses axis 0 of a 0-d tensor (see the module)
    propagate_nan(gm)  # ONNX Runtime's max/min reductions skip NaN (see the module)
    exact_floor_divisions(gm)  # onnxscript's floordiv of sizes truncates (see the module)
    if DIRECT_TRANSLATION:
        try:
            with _exporter_settings(gm):
                model = direct_translation.translate(deep_copy(gm), opset_version=opset_version)
            TRANSLATIONS["direct"] += 1
            return model
        except Exception as error:  # whatever it is, torch.onnx's own path gets its chance
            TRANSLATIONS["torch.onnx.export"] += 1
            logger.debug("exporting through torch.onnx.export: %s", _summarize_export_error(error)[0])
    try:
        direct_translation.inline_math_forms(gm)
    except NoMathForm as error:
        raise ExportError(str(error)) from error
    try:
        # torch.onnx would translate training-mode batch norm as inference: never let it see one.
        direct_translation.decompose_late_ops(gm)
    except Exception as error:
        raise ExportError(f"cannot decompose {type(error).__name__}: {error}") from error
    infinity_checks_in_double(gm)  # after the math forms, which check for -inf too
    examples, dynamic = _example_inputs(placeholders)
    compile_now(gm)
    try:
        with _exporter_settings(gm), reused_op_registry(), lean_decomposition():
            program = torch.onnx.export(
                gm,
                tuple(examples),
                dynamic_shapes=tuple(dynamic) if any(d is not None for d in dynamic) else None,
                dynamo=True,
                optimize=True,
                opset_version=opset_version,
                verbose=False,
            )
    except Exception as error:  # the exporter raises many types; all mean "cannot export"
        raise ExportError(*_summarize_export_error(error)) from error
    return program.model


@contextlib.contextmanager
def _exporter_settings(gm: torch.fx.GraphModule) -> Iterator[None]:
    """How torch.onnx's translator runs for ``gm`` on either path: quiet, its rewrite rules tried
    by root operator, shape inference only where a shape is unknown, operator signatures shared,
    and a float64 graph's numbers as float64 constants (see the modules)."""
    with (
        _quiet_exporter(),
        rewrite_rules_tried_by_root_operator(),
        shape_inference_only_where_unknown(),
        op_signatures_shared(),
        python_floats_as_double(gm),
    ):
        yield


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter warns about things that do not concern ortrain's users (torchvision, say)."""
    # The fake tensors' logger reports, at ERROR, every meta kernel that fails on symbolic sizes
    # before the decomposition that handles them is tried: not failures of the export.
    names = ("torch.onnx", "torch.export", "onnx_ir", "onnxscript", "torch._export")
    names += ("torch._subclasses.fake_tensor",)
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.CRITICAL if lg.name.endswith("fake_tensor") else logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


_NO_FUNCTION = re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _summarize_export_error(error: Exception) -> tuple[str, str | None]:
    """One line for the user, and the operator that has no ONNX translation if that is the cause."""
    text = _ANSI.sub("", str(error))
    missing = _NO_FUNCTION.search(text)
    if missing:
        name = f"{missing.group(1)}.{missing.group(2)}"
        return f"operator {name} has no ONNX translation", name
    if "## Exception summary" in text:
        text = text.split("## Exception summary", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("(Refer")]
    return " ".join(lines)[:600] or type(error).__name__, None
