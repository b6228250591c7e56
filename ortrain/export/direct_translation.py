"""Translate an AOTAutograd FX graph to ONNX node by node, without ``torch.export``.

``torch.onnx.export`` first re-traces the graph module through ``torch.export`` (an FX
interpreter under fake tensors: about 8 ms per node on the 2-core machine), then re-traces it
again through ``run_decompositions`` whenever one operator lacks a translation (the backward
graphs always have some: ``native_layer_norm_backward``, ``gelu_backward``, ...). ortrain's
graphs come out of AOTAutograd already functional, decomposed and annotated with a value per node,
which is everything torch.onnx's translator reads. So this module:

1. replaces each node whose operator has no translation by the nodes of torch.onnx's own
   decomposition of it, traced alone on that node's fake values (milliseconds per node, not a
   re-trace of the graph);
2. inserts torch.onnx's explicit type promotions (its own pass, reading the values the nodes
   already carry: :mod:`ortrain.export.recorded_type_promotion`) and drops the assertion nodes, as
   its export does;
3. hands the FX graph to torch.onnx's translator (the same per-node translation, the same
   onnxscript functions, the same metadata naming each ONNX node's FX node);
4. optimizes as ``torch.onnx.export(optimize=True)`` does.

Measured on the tiny GPT of ``ortrain bench`` (2-core AMD EPYC, loaded): forward graph 4.0 s
through ``torch.onnx.export``, 1.2 s here; backward 7.5 s, 4.9 s. Anything this path does not
handle (a higher-order op, a decomposition that leaves an untranslated operator, an opset below
torchlib's) raises :class:`Unsupported`, and the caller exports through ``torch.onnx.export``
instead, which gives the same ONNX operators.

torch.onnx's private exporter API is used in this file (and the other files of ``export/``) only.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from ortrain.capture.decompositions import decomposition_table
from ortrain.capture.fake_tracing import copy_before, trace_on_values
from ortrain.capture.late_decompositions import decomposed_for_export, late_decompositions
from ortrain.export.double_precision_infinity_checks import infinity_checks_in_double
from ortrain.export.double_precision_sizes import sizes_as_double
from ortrain.export.exporter_decompositions import (
    node_needs_decomposition,
    onnx_decomposition_table,
    translated_operators,
)
from ortrain.export.flash_attention_math import MATH_FORMS, NoMathForm, laid_out_like, math_form_applies
from ortrain.export.half_precision_numbers import size_numbers_in_float32
from ortrain.export.number_operands import tensors_for_number_operands
from ortrain.export.numel_as_sizes import numel_as_sizes
from ortrain.export.onnx_translations import torchlib_registry
from ortrain.export.recorded_type_promotion import insert_type_promotion_nodes


class Unsupported(RuntimeError):
    """This graph needs torch.onnx's full export path (the message says why)."""


def translate(gm: torch.fx.GraphModule, *, opset_version: int) -> Any:
    """The optimized ``onnx_ir.Model`` of ``gm`` (which this function edits: pass a copy)."""
    import onnx_ir as ir
    from torch.onnx._internal._lazy_import import onnxscript_apis
    from torch.onnx._internal.exporter import _constants, _core, _fx_passes, _ir_passes

    if opset_version < _constants.TORCHLIB_OPSET:
        raise Unsupported(f"opset {opset_version} is below torchlib's {_constants.TORCHLIB_OPSET}")
    registry = torchlib_registry(opset_version)
    inline_math_forms(gm)
    decompose_late_ops(gm)
    _decompose_untranslated(gm, translated_operators(registry), lambda: onnx_decomposition_table(registry)[1])
    tensors_for_number_operands(gm)  # again: `rsub(x, 1.0)` decomposes to `sub(1.0, x)`
    infinity_checks_in_double(gm)  # onnxscript checks float64 in float32, where 1e300 is inf
    sizes_as_double(gm)  # again: batch norm's backward decomposes to numbers of its sizes
    size_numbers_in_float32(gm)
    insert_type_promotion_nodes(gm)
    gm = _fx_passes.remove_assertion_nodes(gm)
    _materialize_constants(gm)
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name="main_graph"),
        ir_version=_constants.ONNX_IR_VERSION,
        producer_name="ortrain",
        producer_version=torch.__version__,
    )
    _core._translate_fx_graph(
        gm.graph, model, graph_like=model.graph, owned_graphs={}, lower="at_conversion", registry=registry
    )
    _ir_passes.add_opset_imports(model)
    # What torch.onnx.export(optimize=True) runs next, so that the same graphs reach ONNX Runtime
    # through either path. (Only onnxscript's basic rewrite rules measured no faster on the tiny
    # GPT, within noise, and left 24 more Reshapes in its forward; none at all left 83 more
    # Transposes in its backward.)
    model = onnxscript_apis.convert_version(model, opset_version)
    return onnxscript_apis.optimize(model)


def inline_math_forms(gm: torch.fx.GraphModule) -> int:
    """Replace each CPU flash attention node that has a math form by its trace (see
    :mod:`ortrain.export.flash_attention_math`); returns how many were replaced. Runs before
    either export path, so that neither meets torch.onnx's translation of the kernel; a flash
    node without a math form raises :class:`NoMathForm`."""

    def traced(call: _DecompositionCall) -> torch.fx.GraphModule:
        math_form, recorded = MATH_FORMS[call.node.target], call.node.meta.get("val")
        table = {call.node.target: lambda *a, **k: laid_out_like(math_form(*a, **k), recorded)}
        return _renamed_in_order(call.trace(table))

    replaced = 0
    traces: dict[Any, torch.fx.GraphModule] = {}  # each layer's attention alike: traced once
    for node in list(gm.graph.nodes):
        if math_form_applies(node):
            call = _DecompositionCall(node)
            _inline(gm.graph, node, _shared_trace(call, traces, traced), call.inputs)
            replaced += 1
        elif node.op == "call_function" and node.target in MATH_FORMS:
            # torch.onnx would translate it with a log-sum-exp of zeros: wrong gradients.
            raise NoMathForm(f"{node.target} has no math form here (dropout, or grouped heads)")
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced


def _renamed_in_order(traced: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``traced`` with its nodes named from their operators in order (``mul``, ``mul_1``): a trace
    numbers them after the size arithmetic it happened to record (more on a process's first
    trace), and the names reach the ONNX graph, which must not depend on what ran before."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in traced.graph.nodes:
        if node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], copies.__getitem__))
            continue
        name = node.name if node.op == "placeholder" else None
        args = torch.fx.map_arg(node.args, copies.__getitem__)
        kwargs = torch.fx.map_arg(node.kwargs, copies.__getitem__)
        copies[node] = graph.create_node(node.op, node.target, args, kwargs, name)  # type: ignore[arg-type]
        copies[node].meta = dict(node.meta)
    return torch.fx.GraphModule(traced, graph)


def decompose_late_ops(gm: torch.fx.GraphModule) -> None:
    """Inline ortrain's decomposition of each operator that captures keep whole for PyTorch's
    kernels (:mod:`ortrain.capture.late_decompositions`), as the capture used to, for ONNX."""
    late = [n for n in gm.graph.nodes if decomposed_for_export(n)]
    if not late:
        return
    # The capture's table too: the inner operators decompose as they did inside a capture.
    table = {**decomposition_table(), **late_decompositions()}
    traces: dict[Any, torch.fx.GraphModule] = {}
    for node in late:
        call = _DecompositionCall(node)
        _inline(gm.graph, node, _shared_trace(call, traces, lambda c: c.trace(table)), call.inputs)
    gm.graph.lint()
    gm.recompile()


def _needs_decomposition(node: torch.fx.Node, translated: set[Any]) -> bool:
    needs = node_needs_decomposition(node, translated)
    if needs is None:
        raise Unsupported(f"node {node.name} ({node.op} {node.target}) is not a functional ATen operator")
    return needs


def _decompose_untranslated(
    gm: torch.fx.GraphModule, translated: set[Any], decompositions: Callable[[], dict[Any, Any]]
) -> None:
    """Replace each node without a translation by the traced nodes of its decomposition.

    Nodes alike (the same operator and arguments on inputs of the same dtype, size and layout,
    as each layer's layer-norm backward) share one trace: 29 nodes of the tiny GPT's graphs, 9
    traces."""
    graph = gm.graph
    traces: dict[Any, torch.fx.GraphModule] = {}
    table: dict[Any, Any] | None = None  # made when a node first needs it

    def checked_trace(table: dict[Any, Any], call: _DecompositionCall) -> torch.fx.GraphModule:
        decomposed = call.trace(table)
        numel_as_sizes(decomposed)
        for inner in decomposed.graph.nodes:
            if inner.op == "call_function" and _needs_decomposition(inner, translated):
                raise Unsupported(f"the decomposition of {call.node.target} leaves {inner.target}")
        return decomposed

    for node in list(graph.nodes):
        if not _needs_decomposition(node, translated):
            continue
        if table is None:
            table = decompositions()
        if node.target not in table:
            raise Unsupported(f"{node.target} has neither a translation nor a decomposition")
        call = _DecompositionCall(node)
        _inline(
            graph, node, _shared_trace(call, traces, functools.partial(checked_trace, table)), call.inputs
        )
    graph.lint()
    gm.recompile()


def _shared_trace(
    call: _DecompositionCall,
    traces: dict[Any, torch.fx.GraphModule],
    trace: Callable[[_DecompositionCall], torch.fx.GraphModule],
) -> torch.fx.GraphModule:
    """``trace(call)``, or the trace of an alike call made earlier (see :func:`_reusable`)."""
    decomposed = traces.get(call.key)
    if decomposed is None:
        decomposed = trace(call)
        if _reusable(decomposed):
            traces[call.key] = decomposed
    return decomposed


class _DecompositionCall:
    """A node's call of its operator: its input nodes (in the order of a traced decomposition's
    placeholders) and a key equal for calls whose traces are equal."""

    def __init__(self, node: torch.fx.Node) -> None:
        self.node = node
        self.flat, self.spec = pytree.tree_flatten((node.args, node.kwargs))
        self.positions = [i for i, arg in enumerate(self.flat) if isinstance(arg, torch.fx.Node)]
        self.inputs: list[torch.fx.Node] = [self.flat[i] for i in self.positions]
        self.values = [n.meta.get("val") for n in self.inputs]
        if any(v is None for v in self.values):
            raise Unsupported(f"an input of {node.name} has no value")
        # An input passed twice is one traced tensor: the key says which inputs are the same node.
        first = {}
        for n in self.inputs:
            first.setdefault(n, len(first))
        leaves = [
            ("input", first[arg], _described(arg.meta["val"]))
            if isinstance(arg, torch.fx.Node)
            else (type(arg).__name__, repr(arg))
            for arg in self.flat
        ]
        self.key = (node.target, str(self.spec), tuple(leaves))

    def trace(self, table: dict[Any, Any]) -> torch.fx.GraphModule:
        """The decomposition traced on the inputs' values."""
        decomposition = table[self.node.target]
        flat, spec, positions = self.flat, self.spec, self.positions

        def call(*tensors: Any) -> Any:
            filled = list(flat)
            for position, tensor in zip(positions, tensors, strict=True):
                filled[position] = tensor
            args, kwargs = pytree.tree_unflatten(filled, spec)
            return decomposition(*args, **kwargs)

        # torch.onnx decomposes size-obliviously, so that a size 0 or 1 stays symbolic.
        traced = trace_on_values(
            call, self.values, decomposition_table=table, size_oblivious=True, graph=self.node.graph
        )
        if _named_tuples_unpacked(traced.graph):
            traced.recompile()
        return traced


def _named_tuples_unpacked(graph: torch.fx.Graph) -> int:
    """Replace each construction of a named tuple by its fields; returns how many. A reference
    with an ``out=`` wrapper (``torch._refs.var_mean``, the decomposition of ``var_mean`` at a
    symbolic size) returns a named tuple that the trace records as a call of its class, which
    no translator knows."""
    unpacked = 0
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not (isinstance(target, type) and issubclass(target, tuple)):
            continue
        if node.kwargs or len(node.args) != len(getattr(target, "_fields", ())):
            continue
        fields = tuple(node.args)

        def as_fields(arg: torch.fx.Node, node: torch.fx.Node = node, fields: tuple = fields) -> Any:
            return fields if arg is node else arg

        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(fields[user.args[1]])
                graph.erase_node(user)
            else:  # the trace's output
                user.args = torch.fx.map_arg(user.args, as_fields)
        if not node.users:
            graph.erase_node(node)
            unpacked += 1
    return unpacked


def _described(value: Any) -> Any:
    """What a trace may depend on in an input's value."""
    if isinstance(value, torch.Tensor):
        return (
            type(value).__name__,
            value.dtype,
            value.layout,
            value.device,
            value.requires_grad,
            tuple(str(s) for s in value.shape),
            tuple(str(s) for s in value.stride()) if value.layout == torch.strided else (),
            str(value.storage_offset()) if value.layout == torch.strided else "",
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value).__name__, str(value.node.expr))
    if isinstance(value, (list, tuple)):
        return tuple(_described(v) for v in value)
    return (type(value).__name__, repr(value))


def _reusable(decomposed: torch.fx.GraphModule) -> bool:
    """A trace that made up a data-dependent size stands for that node alone: another node's
    size is another symbol."""
    return not any(free_unbacked_symbols(n.meta.get("val")) for n in decomposed.graph.nodes)


def _inline(
    graph: torch.fx.Graph, node: torch.fx.Node, decomposed: torch.fx.GraphModule, inputs: list[torch.fx.Node]
) -> None:
    result = copy_before(graph, node, decomposed, inputs)
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise Unsupported(f"a multi-output {node.target} is read without getitem")
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)


def _materialize_constants(gm: torch.fx.GraphModule) -> None:
    """torch.onnx's translator reads a constant's data from its node's value, which AOTAutograd
    leaves fake (or absent): give it the module's real tensor."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            raise Unsupported(f"constant {node.target} is a {type(value).__name__}")
        node.meta["val"] = value
