"""Python floats in a float64 graph become float64 constants of ONNX, not float32 ones.

torch.onnx makes an ONNX constant of each Python number an operator's translation takes. Where
the translation's signature does not tie the number's type to a tensor's (a ``TReal`` of its
own), it makes a Python float a FLOAT constant, which the translation then casts to its
operand's type: in a float64 model ``x * 0.1`` multiplied by 0.10000000149011612 and
``clamp(min=0.7)`` clamped at 0.699999988, relative errors of 1e-8 where eager PyTorch computes
with the number itself (wave 38's trials: 14 of 20 common forms, ``where``, ``rsub``, ``lerp``,
``full_like``, ``torch.pi`` among them).

While a graph whose floating tensors are all float64 is translated, such a float becomes a
DOUBLE constant instead: its exact value, and the type of every floating tensor it can meet in
that graph. Graphs with any other floating dtype are translated as before: there a DOUBLE
constant could meet a float32 tensor in an ONNX operator that takes one type. The switch is per
thread, so a float32 graph exported on another thread meanwhile is untouched.

A few translations pass their number as an ONNX attribute, which the format keeps in float32
whatever the tensors' type: ``addcmul``'s and ``addcdiv``'s ``value``, ``hardtanh``'s bounds.
In such a graph those nodes are first written as the arithmetic PyTorch's CPU kernels do
(``self + value * t1 * t2``, ``self + value * t1 / t2``, a ``clamp``), whose numbers are operands.
(``addbmm``'s ``alpha`` and ``beta`` are decomposed while capturing:
:func:`ortrain.capture.decompositions_math.addbmm`. Eval-mode batch norm's ``epsilon`` is one
too: a float64 one is decomposed with the operators captures keep whole,
:func:`ortrain.capture.late_decompositions.decomposed_for_export`.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ortrain.export.spelled_out_math import NodeBuilder, rewrite_nodes

aten = torch.ops.aten
_state = threading.local()
_installed = False
_install_lock = threading.Lock()


def all_floats_double(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm``'s floating tensors are all float64, but for index arithmetic
    (:func:`_index_arithmetic`)."""
    index_arithmetic = _index_arithmetic(gm.graph)
    dtypes = {n.meta["val"].dtype for n in gm.graph.nodes if _floating(n) and n not in index_arithmetic}
    return dtypes == {torch.float64}


def _index_arithmetic(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The non-float64 floating nodes computed from sizes and numbers alone, whose every use ends
    in casts to integer tensors: the source indices that PyTorch's decompositions compute in float32
    whatever the model's dtype (upsample-nearest's ``(arange(n, dtype=float32) + offset) *
    scale``, cast to int64; at an open size ``scale`` is double_precision_sizes' float64 number
    cast to float32). No tensor of the model meets them, and the translations tie a number to its
    tensor operand's type, so their numbers stay float32 in a graph translated with DOUBLE ones;
    counting them made a float64 model with ``F.interpolate(mode="nearest")`` round every Python
    float to float32 (3e-8 off, wave 54). A float32 value computed from the model's floating
    tensors (``x.float()``), or reaching a floating or boolean result, still counts."""
    sized: set[torch.fx.Node] = set()  # computed from sizes, integers and numbers alone
    for node in graph.nodes:
        if node.op == "call_function" and all(n in sized or not _real(n) for n in node.all_input_nodes):
            sized.add(node)
    to_integers: set[torch.fx.Node] = set()  # ... and used only on the way to integer tensors
    for node in reversed(graph.nodes):
        if node in sized and all(u in to_integers or _cast_to_integers(u) for u in node.users):
            to_integers.add(node)
    return {n for n in to_integers if _floating(n) and n.meta["val"].dtype != torch.float64}


def _floating(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _real(node: torch.fx.Node) -> bool:
    """A floating tensor or a real number (``x.item()``, ``sym_float(n)``)."""
    return _floating(node) or isinstance(node.meta.get("val"), (float, torch.SymFloat))


# Casts: an integer result of another operator (``bucketize(x, boundaries)``) may have met a
# tensor of the model.
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _cast_to_integers(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    if node.target not in _CASTS or not isinstance(value, torch.Tensor) or value.dtype == torch.bool:
        return False
    return not value.is_floating_point() and not value.is_complex()


def _install() -> None:
    """Wrap torch.onnx's choice of a Python constant's type, once per process; the wrapper
    changes it only on a thread inside :func:`python_floats_as_double`."""
    global _installed
    with _install_lock:
        if _installed:
            return
        import onnx_ir as ir
        from torch.onnx._internal.exporter import _building

        chosen_by_torch = _building._determine_input_dtype

        def determine_input_dtype(param: Any, arg: Any, type_binding: Any) -> Any:
            dtype = chosen_by_torch(param, arg, type_binding)
            if (
                (getattr(_state, "double", False) or isinstance(arg, DoubleConstant))
                and dtype == ir.DataType.FLOAT
                and isinstance(arg, float)
                and param.type_constraint not in type_binding
                and any(t.dtype == ir.DataType.DOUBLE for t in param.type_constraint.allowed_types)
            ):
                return ir.DataType.DOUBLE
            return dtype

        _building._determine_input_dtype = determine_input_dtype
        _installed = True


class DoubleConstant(float):
    """A Python number that becomes a DOUBLE constant in any graph (a float64 operand of size
    arithmetic: :mod:`ortrain.export.double_precision_sizes`), where torch.onnx would round it
    to float32 first (``scalar_tensor(1.7, dtype=float64)`` held 1.70000005)."""


@contextlib.contextmanager
def python_floats_as_double(gm: torch.fx.GraphModule) -> Iterator[None]:
    """Translate ``gm``'s Python floats as DOUBLE constants meanwhile, if its floating tensors are
    all float64 (else only the :class:`DoubleConstant` numbers)."""
    _install()
    if not all_floats_double(gm):
        yield
        return
    previous = getattr(_state, "double", False)
    _state.double = True
    try:
        yield
    finally:
        _state.double = previous


def _scaled_product(b: NodeBuilder, node: torch.fx.Node, combine: Any) -> torch.fx.Node:
    self_arg, t1, t2 = node.args[:3]
    value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else 1)
    scaled = b.call(aten.mul.Tensor, t1, b.operand(value))  # the kernels' order: (value * t1) op t2
    return b.call(aten.add.Tensor, self_arg, b.call(combine, scaled, t2))


def _clamped(b: NodeBuilder, node: torch.fx.Node) -> torch.fx.Node:
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
    return b.call(aten.clamp.default, node.args[0], low, high)


_ATTRIBUTE_FORMS = {
    aten.addcmul.default: lambda b, n: _scaled_product(b, n, aten.mul.Tensor),
    aten.addcdiv.default: lambda b, n: _scaled_product(b, n, aten.div.Tensor),
    aten.hardtanh.default: _clamped,
}


def numbers_as_operands(gm: torch.fx.GraphModule) -> int:
    """In a graph whose floating tensors are all float64, write the nodes whose translations
    make their numbers float32 attributes as arithmetic on operands; returns how many."""
    if not all_floats_double(gm):
        return 0
    return rewrite_nodes(gm, _with_operands)


def _with_operands(node: torch.fx.Node) -> torch.fx.Node | None:
    form = _ATTRIBUTE_FORMS.get(node.target) if node.op == "call_function" else None
    value = node.meta.get("val")
    if form is None or not isinstance(value, torch.Tensor):
        return None
    return form(NodeBuilder(node.graph, value), node)
