"""What the exporter can translate, and which FX node an exported ONNX node came from.

The private parts of torch.onnx's exporter that the runtime's partitioner needs live here, so a
torch upgrade that moves them touches this file only.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
from typing import Any

import onnx
import torch

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


@functools.cache
def _registry() -> Any:
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it warns that torchvision is not installed
    try:
        return ONNXRegistry.from_torchlib()
    finally:
        quiet.setLevel(level)


@functools.cache
def _decomposed() -> frozenset[Any]:
    # torch.onnx decomposes these (torch.export's default table) before translating.
    return frozenset(torch.export.default_decompositions().keys())


def has_onnx_translation(target: Any) -> bool:
    """Whether torch.onnx has an ONNX function for this FX ``call_function`` target, directly or
    after torch.export's default decompositions."""
    if target in _SYMBOLIC or target is torch.ops.aten.sym_size.int:
        return True
    try:
        if target in _decomposed():
            return True
        return bool(_registry().is_registered(target))
    except Exception:  # an op the registry cannot even name has no translation
        return False


def decomposed_at_export(target: Any) -> bool:
    """torch.onnx translates this op through a decomposition, so its ONNX nodes carry the names of
    the decomposition's nodes, not of the FX node."""
    try:
        return target in _decomposed() and not _registry().is_registered(target)
    except Exception:
        return False


_FX_NODE = re.compile(r"^%(\S+) :")


def fx_node_name(node: onnx.NodeProto) -> str | None:
    """The name of the FX node that ``node`` was translated from, from the exporter's metadata."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.fx_node":
            found = _FX_NODE.match(prop.value)
            if found:
                return found.group(1)
    return None
