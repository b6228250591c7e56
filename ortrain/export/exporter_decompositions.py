"""torch.onnx's decomposition step, skipped where it would change nothing and its table built once.

``torch.onnx.export`` re-traces every exported program through ``run_decompositions`` with a table
of the decompositions of the operators it has no ONNX translation for. Building that table takes
about 0.3 s and the re-trace about 1 s even for a one-node graph (2-core machine): most of an
export. ortrain exports graphs that AOTAutograd has already decomposed and functionalized, and
the ONNX Runtime executor exports many small regions when it splits a graph between executors
(a bfloat16 model: one per run of nodes with CPU kernels). So, while ortrain exports:

- a program whose every operator has an ONNX translation is not re-traced: no decomposition
  applies to it, and the re-trace would return the same operators. Any other program (an
  operator a decomposition rewrites, a higher-order op, a call that is not an ATen operator or
  size arithmetic) goes through torch.onnx's own step unchanged;
- the table is built once per set of translated operators and decompositions, not per export.

The private exporter API patched here is used in this file only, so a torch upgrade that moves it
touches this file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Python functions on sizes that torch.onnx translates itself (dynamic shapes).
_SIZE_ARITHMETIC_MODULES = ("_operator", "math")
# Checks that torch.export inserts and torch.onnx removes after the decomposition step.
ASSERTIONS = frozenset(
    {
        torch.ops.aten.sym_constrain_range_for_size.default,
        torch.ops.aten._assert_async.default,
        torch.ops.aten._assert_async.msg,
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten._assert_tensor_metadata.default,
    }
)
_TABLES: dict[tuple[frozenset[Any], int], dict[Any, Callable[..., Any]]] = {}
_TRANSLATED: dict[int, set[Any]] = {}  # by id() of one of onnx_translations' shared registries


def node_needs_decomposition(node: torch.fx.Node, translated: set[Any]) -> bool | None:
    """False: ``node`` translates as it is (a translated functional operator, size arithmetic, an
    assertion, a placeholder/output/constant). True: a functional ATen operator without a
    translation. None: neither (a mutating op, a higher-order op, a Python call), which only
    torch.onnx's own re-trace may handle."""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op != "call_function":
        return None
    target = node.target
    if target in ASSERTIONS:
        return False
    if isinstance(target, torch._ops.OpOverload):
        # A mutating op would be functionalized by the re-trace: keep it.
        return None if target._schema.is_mutable else target not in translated
    # Size arithmetic: Python's operators, and those torch.onnx translates (``torch.sym_float``,
    # which a decomposition's ``sum / n`` at a symbolic ``n`` calls).
    if target in translated or getattr(target, "__module__", None) in _SIZE_ARITHMETIC_MODULES:
        return False
    return None


def needs_no_decomposition(graph_module: torch.fx.GraphModule, translated: set[Any]) -> bool:
    """Whether every call in ``graph_module`` is an operator in ``translated`` or size arithmetic."""
    return all(
        isinstance(module, torch.fx.GraphModule)
        and all(node_needs_decomposition(node, translated) is False for node in module.graph.nodes)
        for module in graph_module.modules()
    )


def _cached_table(
    translated: set[Any], build: Callable[[set[Any]], dict[Any, Callable[..., Any]]]
) -> dict[Any, Callable[..., Any]]:
    # torch's decomposition table only grows (registrations): its size tells its version.
    key = (frozenset(translated), len(torch._decomp.decomposition_table))
    if key not in _TABLES:
        _TABLES[key] = build(translated)
    return _TABLES[key]


def translated_operators(registry: Any) -> set[Any]:
    """The operators ``registry`` translates (read it only: the set is shared)."""
    from torch.onnx._internal.exporter import _decomp

    translated = _TRANSLATED.get(id(registry))
    if translated is None:  # the registries are made once per process and never change
        # A lazy registry names its operators without building their entries.
        lazy = getattr(registry, "implemented_targets", None)
        targets = lazy() if lazy is not None else _decomp.get_onnx_implemented_overloads(registry)
        translated = _TRANSLATED[id(registry)] = set(targets)
    return translated


def onnx_decomposition_table(registry: Any) -> tuple[set[Any], dict[Any, Callable[..., Any]]]:
    """The operators ``registry`` translates, and torch.onnx's decompositions of the others (read
    them only: the table is shared). The table lists every decomposition torch has: 0.1-0.3 s the
    first time, which a graph whose operators all translate never needs."""
    from torch.onnx._internal.exporter import _decomp

    translated = translated_operators(registry)
    return translated, _cached_table(translated, _decomp.create_onnx_friendly_decomposition_table)


@contextlib.contextmanager
def lean_decomposition() -> Iterator[None]:
    """While exporting: skip the re-trace of programs that need no decomposition; reuse the table.

    Exports are serialized by ortrain's compile lock, like the rest of the export's patches."""
    from torch.onnx._internal.exporter import _decomp, _fx_passes

    original_step = _fx_passes.decompose_with_registry
    original_table = _decomp.create_onnx_friendly_decomposition_table

    def decompose_with_registry(program: torch.export.ExportedProgram, registry: Any) -> Any:
        translated = set(_decomp.get_onnx_implemented_overloads(registry))
        if needs_no_decomposition(program.graph_module, translated):
            return program
        return original_step(program, registry)

    def table(translated: set[Any]) -> dict[Any, Callable[..., Any]]:
        return dict(_cached_table(translated, original_table))

    _fx_passes.decompose_with_registry = decompose_with_registry
    _decomp.create_onnx_friendly_decomposition_table = table
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = original_step
        _decomp.create_onnx_friendly_decomposition_table = original_table
