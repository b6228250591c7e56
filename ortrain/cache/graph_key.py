"""The cache key of one FX graph's export: everything the exported ONNX model depends on.

The graph itself stands for the model: its code (every operator, argument and constant of the
forward or backward graph that AOTAutograd captured), each node's dtype and shape (symbolic sizes
as formulas, placeholders also with the size hint the export traces with), and the bytes of every
tensor the graph holds as an attribute. Model code, config, parameter shapes and dtypes, input
signature, requires-grad pattern, training/eval mode and every option that changes the captured
graph (memory optimizer, checkpointing, custom Functions) change one of these. Beside the graph:
the opset, the versions of Python, torch, onnx, onnxscript, onnxruntime and ortrain, and a hash of
ortrain's whole source, so that a changed exporter never reads an old entry.
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
def ortrain_code_hash() -> str:
    """SHA-256 of every Python file of ortrain, with its path. An export runs code from most of
    ortrain (export/, capture/, passes/, runtime/, errors, the cache's entry format); until wave
    54 the export key hashed a list of 18 of those files, and an entry written by an exporter
    whose fix lay in another (export/nan_propagation.py) was read by the fixed one. Read once
    per process (~450 files, ~50 ms on the 2-core machine; the capture key reads it too)."""
    digest = hashlib.sha256()
    root = Path(ortrain.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# What the export and translations entries are keyed with: all of ortrain's code, as captures are.
export_code_hash = ortrain_code_hash


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
