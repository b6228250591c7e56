"""Captures through ``ORTMODULE_CACHE_DIR``: a later process with the same model, code, inputs and
options runs the stored capture instead of tracing the model (key: ``capture_key.py``)."""

from __future__ import annotations

import dataclasses
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortrain.cache.capture_key import files_changed, loaded_user_files
from ortrain.cache.graph_key import versions
from ortrain.cache.store import CacheStore
from ortrain.capture.aot_capture import Capture
from ortrain.capture.capture_package import load_package, package_bytes
from ortrain.capture.memory_optimizer import MemoryReport
from ortrain.capture.size_guards import SizeGuards
from ortrain.runtime.startup_timings import timed

logger = logging.getLogger("ortrain.cache")
KIND = "capture"
_warned_shared: set[Path] = set()


def _private_store(cache_dir: Path) -> CacheStore | None:
    store = CacheStore(cache_dir)
    if store.private():
        return store
    if store.usable and cache_dir not in _warned_shared:
        _warned_shared.add(cache_dir)
        logger.warning(
            "ORTMODULE_CACHE_DIR=%s can be written by other users (or is not yours): captures are not "
            "cached there, since loading one runs code; exports still are (chmod go-w the directory)",
            cache_dir,
        )
    return None


@dataclass
class _Stored:
    package: bytes
    state_names: list[str]
    output_spec: Any
    memory_report: Any
    size_guards: SizeGuards
    mutated_inputs: frozenset[int]
    # The user's files loaded when the capture was stored. The key hashes those loaded before the
    # trace; a module a forward imports (``import helpers`` inside it) is first loaded by the
    # trace, so its file is checked here at load (until wave 41 an edit to it went unseen).
    code_files: dict[str, str]
    running_statistics: frozenset[int] = frozenset()


def load_capture(
    cache_dir: Path, key: str, *, training: bool, dynamic_dims: dict[int, tuple[int, ...]]
) -> tuple[Capture, Any] | None:
    """The stored capture and its output spec, or None (a miss, or an entry that cannot be read:
    logged at WARNING, removed and rebuilt)."""
    store = _private_store(cache_dir)
    if store is None:
        return None
    payload = store.load(KIND, key)
    if payload is None:
        return None
    try:
        with timed("capture (cached)"):
            stored = pickle.loads(payload)
            assert isinstance(stored, _Stored)
            changed = files_changed(stored.code_files)
            if changed:
                logger.info("a file the stored capture ran has changed (%s): capturing again", changed[0])
                return None
            loaded = load_package(stored.package)
    except Exception as error:
        # A whole entry (its checksum passed) that this ortrain cannot read: a torch private type
        # that changed within one version string, say.
        logger.warning("cache entry %s cannot be read (%s); capturing again", store.path(KIND, key), error)
        store.remove(KIND, key)
        return None
    logger.debug("capture loaded from %s", store.path(KIND, key))
    captured = Capture(
        fn=loaded.fn,
        state_names=stored.state_names,
        forward=loaded.forward,
        backward=loaded.backward,
        training=training,
        dynamic_dims=dynamic_dims,
        memory_report=stored.memory_report,
        size_guards=stored.size_guards,
        mutated_inputs=stored.mutated_inputs,
        running_statistics=stored.running_statistics,
    )
    return captured, stored.output_spec


def save_capture(cache_dir: Path, key: str, captured: Capture, output_spec: Any, *, model: str) -> None:
    """Store ``captured`` (recorded with ``package=True``) unless it cannot be: graphs that call
    Python objects of this process, or a part pickle refuses (logged at DEBUG; the export cache
    still serves)."""
    if captured.package_entry is None:
        logger.debug("capture not cached: its graphs call Python functions of this process")
        return
    store = _private_store(cache_dir)
    if store is None:
        captured.package_entry = None
        return
    try:
        with timed("capture (store)"):
            stored = _Stored(
                package_bytes(captured.package_entry),
                captured.state_names,
                output_spec,
                _without_graph_nodes(captured.memory_report),
                captured.size_guards,
                captured.mutated_inputs,
                loaded_user_files(),
                captured.running_statistics,
            )
            payload = pickle.dumps(stored)
    except Exception as error:
        logger.debug("capture not cached: %s: %s", type(error).__name__, error)
        return
    finally:
        captured.package_entry = None  # the entry holds the graphs twice over; not needed any more
    nodes = sum(len(slot.graph.graph.nodes) for slot in (captured.forward, captured.backward) if slot)
    header = {"what": f"capture {model}", "nodes": nodes, "versions": versions()}
    store.save(KIND, key, payload, header)


def _without_graph_nodes(report: MemoryReport | None) -> MemoryReport | None:
    """The report as data: its occurrences name the joint graph's nodes, which only the planning
    that already ran reads (and which belong to this process's graph)."""
    if report is None:
        return None
    plans = [
        dataclasses.replace(
            plan, occurrences=[dataclasses.replace(o, nodes=[], root=None) for o in plan.occurrences]
        )
        for plan in report.plans
    ]
    return dataclasses.replace(report, plans=plans)
