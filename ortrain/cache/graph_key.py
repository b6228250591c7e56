"""The cache key of one FX graph's export: everything the exported ONNX model depends on.

The graph itself stands for the model: its code (every operator, argument and constant of the
forward or backward graph that AOTAutograd captured), each node's dtype and shape (symbolic sizes
as formulas, placeholders also with the size hint the export traces with), and the bytes of every
tensor the graph holds as an attribute. Model code, config, parameter shapes and dtypes, input
signature, requires-grad pattern, training/eval mode and every option that changes the captured
graph (memory optimizer, checkpointing, custom Functions) change one of these. Beside the graph:
the opset, the versions of Python, torch, onnx, onnxscript, onnxruntime and ortrain, and a hash of
the source of ortrain's export code, so that a changed exporter never reads an old entry.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import torch

import ortrain

# ortrain's own code that turns an FX graph into an ExportedGraph, and the entry format.
_EXPORT_SOURCES = (
    "export/fx_to_onnx.py",
    "export/exported_graph_io.py",
    "export/onnx_translations.py",
    "export/index_dtypes.py",
    "export/exporter_decompositions.py",
    "export/direct_translation.py",
    "export/rewrite_rules_by_root.py",
    "export/exact_constant_patterns.py",
    "export/lazy_op_registry.py",
    "export/recorded_type_promotion.py",
    "export/factory_dtypes.py",
    "export/negative_indices.py",
    "export/spelled_out_math.py",
    "export/op_signatures.py",
    "capture/view_ops.py",
    "capture/fake_tracing.py",
    "cache/graph_key.py",
    "cache/store.py",
)


@functools.cache
def versions() -> dict[str, str]:
    found = {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "ortrain": ortrain.__version__}
    for package in ("torch", "onnx", "onnxscript", "onnxruntime"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


@functools.cache
def export_code_hash() -> str:
    digest = hashlib.sha256()
    root = Path(ortrain.__file__).parent
    for relative in _EXPORT_SOURCES:
        digest.update(relative.encode())
        digest.update((root / relative).read_bytes())
    return digest.hexdigest()


def _describe(value: Any, *, hints: bool) -> Any:
    if isinstance(value, torch.Tensor):
        shape = [_describe(s, hints=hints) for s in value.shape]
        return {"dtype": str(value.dtype), "shape": shape, "device": value.device.type}
    if isinstance(value, torch.SymInt):
        described: dict[str, Any] = {"expr": str(value.node.expr)}
        if hints:
            described["hint"] = value.node.hint
        return described
    if isinstance(value, (list, tuple)):
        return [_describe(v, hints=hints) for v in value]
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    return type(value).__name__


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's values."""
    data = tensor.detach().cpu().contiguous().reshape(-1)  # a 0-d constant has no dim to view as bytes
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()


def graph_description(gm: torch.fx.GraphModule) -> dict[str, Any]:
    nodes = []
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {
            "name": node.name,
            "op": node.op,
            "target": str(node.target),
            "val": _describe(node.meta.get("val"), hints=node.op == "placeholder"),
        }
        if node.op == "get_attr":
            attr = gm
            for part in str(node.target).split("."):
                attr = getattr(attr, part)
            if isinstance(attr, torch.Tensor):
                entry["bytes"] = tensor_digest(attr)
                entry["attr"] = _describe(attr, hints=False)
        nodes.append(entry)
    # The graph's source as a module would generate it, without compiling it (``gm.code`` does).
    return {"code": gm.graph.python_code(root_module="self").src, "nodes": nodes}


def export_key(gm: torch.fx.GraphModule, *, opset_version: int) -> str:
    material = {
        "graph": graph_description(gm),
        "opset": opset_version,
        "versions": versions(),
        "export_code": export_code_hash(),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()
