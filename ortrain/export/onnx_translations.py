"""What the exporter can translate, and which FX node an exported ONNX node came from.

The private parts of torch.onnx's exporter that the runtime's partitioner needs live here, so a
torch upgrade that moves them touches this file only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
from collections.abc import Iterator
from typing import Any

import onnx
import torch

from ortrain.capture.late_decompositions import LATE_OPS

logger = logging.getLogger("ortrain.export")

# Python-level operators on sizes that torch.onnx translates itself (dynamic shapes).
_SYMBOLIC = frozenset(
    {
        operator.getitem,
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.truediv,
        operator.neg,
        operator.pow,
    }
)


# torch.onnx's aten-to-ONNX registry for each opset, made once per process and shared by the
# partitioner and every export (torch.onnx.export would build its own on every call). Each
# operator's entries are built the first time it is looked up (see lazy_op_registry): the whole
# registry took 0.6-1.1 s to build on the 2-core machine.
_OP_REGISTRIES: dict[int, Any] = {}


def torchlib_registry(opset_version: int | None = None) -> Any:
    """The registry for ``opset_version`` (the exporter's own opset if None). Read it only."""
    from torch.onnx._internal.exporter import _constants

    from ortrain.export.lazy_op_registry import LazyTorchlibRegistry

    opset = _constants.TORCHLIB_OPSET if opset_version is None else opset_version
    registry = _OP_REGISTRIES.get(opset)
    if registry is None:
        quiet = logging.getLogger("torch.onnx")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # it warns that torchvision is not installed
        try:
            registry = _OP_REGISTRIES[opset] = LazyTorchlibRegistry(opset)
        finally:
            quiet.setLevel(level)
    return registry


@contextlib.contextmanager
def reused_op_registry() -> Iterator[None]:
    """While exporting, hand ``torch.onnx.export`` a copy of :func:`torchlib_registry`'s table
    instead of letting it build its own. The exporter only reads it; each call still gets its own
    copy, so a caller that registers ops on its registry changes no other's. Exports are
    serialized by ortrain's compile lock."""
    from torch.onnx._internal.exporter import _constants, _registration

    registry_class = _registration.ONNXRegistry
    original = registry_class.__dict__["from_torchlib"]

    def from_torchlib(cls: type, opset_version: int = _constants.TORCHLIB_OPSET) -> Any:
        master = torchlib_registry(opset_version)
        registry = cls()
        registry._opset_version = master._opset_version
        registry.functions = {target: list(metas) for target, metas in master.functions.items()}
        return registry

    registry_class.from_torchlib = classmethod(from_torchlib)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        registry_class.from_torchlib = original  # type: ignore[method-assign]


@functools.cache
def _decomposed() -> frozenset[Any]:
    # Ops torch.export / torch.onnx may decompose before translating (into ops that may or may
    # not have a translation: the export itself then says).
    from torch._decomp import decomposition_table

    return frozenset(torch.export.default_decompositions().keys()) | frozenset(decomposition_table)


def _registered(target: Any) -> bool:
    try:
        registry = torchlib_registry()
        if registry.is_registered(target):
            return True
        # The registry falls back from an overload to the op's default translation.
        return f"{target.namespace}::{target._opname}" in registry.functions
    except Exception:  # an op the registry cannot even name has no translation
        return False


@functools.cache
def _incomplete_translations() -> frozenset[Any]:
    # Registered, but the translation computes fewer outputs than the op has: onnxscript's
    # ``_linalg_det`` is ONNX's Det alone, without the LU factors and pivots that the op also
    # returns (and its backward reads), so ONNX Runtime fails on the missing outputs.
    return frozenset({torch.ops.aten._linalg_det.default})


def has_onnx_translation(target: Any) -> bool:
    """Whether torch.onnx can translate this FX ``call_function`` target: directly, or (as far as
    one can tell before exporting) through a decomposition."""
    if target in _SYMBOLIC or target is torch.ops.aten.sym_size.int:
        return True
    if target in LATE_OPS:  # decomposed by ortrain before the export
        return True
    if target in _incomplete_translations():
        return False
    return _registered(target) or target in _decomposed()


def decomposed_at_export(target: Any) -> bool:
    """torch.onnx translates this op through a decomposition, so its ONNX nodes carry the names of
    the decomposition's nodes, not of the FX node."""
    # The registry first: a model whose operators all translate never lists torch's
    # decompositions (0.1-0.3 s).
    return target in LATE_OPS or (not _registered(target) and target in _decomposed())


_FX_NODE = re.compile(r"^%(\S+) :")
_FX_TARGET = re.compile(r"call_function\[target=([^\]]+)\]")


def fx_origins(model: onnx.ModelProto, graph: torch.fx.Graph) -> dict[str, str]:
    """ONNX node name -> the node of ``graph`` it was translated from, where that can be told.

    torch.onnx re-traces the graph, and may rename its nodes (``mm_default`` becomes ``mm``): a
    name that is not in ``graph`` is matched by its target and its rank among the nodes of that
    target, as re-tracing keeps their order.
    """
    names = {n.name for n in graph.nodes}
    by_target: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            by_target.setdefault(_target_text(node.target), []).append(node.name)
    seen: dict[str, list[str]] = {}  # target -> re-traced node names in order of appearance
    origins: dict[str, str] = {}
    for onnx_node in model.graph.node:
        props = {p.key: p.value for p in onnx_node.metadata_props}
        text = props.get("pkg.torch.onnx.fx_node", "")
        named, target = _FX_NODE.match(text), _FX_TARGET.search(text)
        if named is None:
            continue
        if named.group(1) in names:
            origins[onnx_node.name] = named.group(1)
            continue
        if target is None:
            continue
        order = seen.setdefault(target.group(1), [])
        if named.group(1) not in order:
            order.append(named.group(1))
        candidates = by_target.get(target.group(1), [])
        rank = order.index(named.group(1))
        if rank < len(candidates):
            origins[onnx_node.name] = candidates[rank]
    return origins


def _target_text(target: Any) -> str:
    """How the exporter's metadata spells a target: ``torch.ops.aten.mm.default``."""
    return f"torch.ops.{target}" if hasattr(target, "_schema") else str(target)
