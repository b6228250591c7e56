"""``export_graph`` through ``ORTMODULE_CACHE_DIR``: the one export call every executor uses."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ortrain.cache.graph_key import export_key, versions
from ortrain.cache.store import CacheStore
from ortrain.export.exported_graph_io import exported_graph_from_bytes, exported_graph_to_bytes
from ortrain.export.fx_to_onnx import ExportedGraph, export_graph
from ortrain.runtime.startup_timings import timed

logger = logging.getLogger("ortrain.cache")
KIND = "export"


def export_graph_cached(
    gm: torch.fx.GraphModule, *, opset_version: int, cache_dir: Path | None, name: str = ""
) -> ExportedGraph:
    """Export ``gm`` (``name`` is for logs: "forward", "backward[2]"), or load it from ``cache_dir``."""
    if cache_dir is None:
        return _export(gm, opset_version=opset_version, name=name)
    store = CacheStore(cache_dir)
    key = export_key(gm, opset_version=opset_version)
    payload = store.load(KIND, key)
    if payload is not None:
        try:
            with timed("export (cached)", name):
                exported = exported_graph_from_bytes(payload)
            logger.debug("%s graph: loaded from %s", name, store.path(KIND, key))
            return exported
        except Exception as error:  # a checksummed entry written by a broken writer
            logger.warning("cache entry %s cannot be read (%s); rebuilding it", store.path(KIND, key), error)
    exported = _export(gm, opset_version=opset_version, name=name)
    header = {"what": name or "graph", "nodes": len(gm.graph.nodes), "versions": versions()}
    try:
        payload = exported_graph_to_bytes(exported)
    except TypeError as error:  # a plan field the entry format cannot hold: run uncached
        logger.warning("%s graph not cached: %s", name or "a", error)
        return exported
    if store.save(KIND, key, payload, header):
        logger.debug("%s graph: stored in %s", name, store.path(KIND, key))
    return exported


def _export(gm: torch.fx.GraphModule, *, opset_version: int, name: str) -> ExportedGraph:
    with timed("export", name):
        return export_graph(gm, opset_version=opset_version)
