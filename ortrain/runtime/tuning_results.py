"""ORTMODULE_TUNING_RESULTS_PATH: the placements chosen on this machine, so a later run skips tuning.

One JSON file (a directory gets ``ortrain_tuning.json`` inside it) maps a key to the chosen
placement and what was measured. The key is everything a choice depends on: the graph itself
(operators, dtypes, shapes: :func:`ortrain.cache.graph_key.graph_description`), the CPU model,
PyTorch's thread count, the OpenMP wait policy, the versions of Python, torch and ONNX Runtime, and
the candidate placements raced. Writes replace the file atomically and merge with what another
process wrote meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ortrain.cache.graph_key import graph_description, versions
from ortrain.runtime.cpu import cpu_name

logger = logging.getLogger("ortrain.runtime")

# 2: keys hash the graph once (graph_digest), then the candidates.
FORMAT = 2
FILE_NAME = "ortrain_tuning.json"


def results_file(path: Path) -> Path:
    return path / FILE_NAME if path.is_dir() else path


def machine() -> dict[str, Any]:
    """What a measured choice holds for: change any of these and tuning runs again."""
    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "").strip().upper(),
        "versions": versions(),
    }


def graph_digest(graph: torch.fx.GraphModule) -> str:
    """What all the tuning keys of ``graph`` share: the graph and the machine. Describing a graph
    walks all its nodes (and hashes its constants) and a graph is looked up under up to three keys
    (one per race, see :mod:`ortrain.runtime.placement_tuning`), so this is computed once a graph."""
    material = {"graph": graph_description(graph), "machine": machine(), "format": FORMAT}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def tuning_key(digest: str, candidates: list[str]) -> str:
    """The key of a choice among ``candidates`` (placement names) for the graph of ``digest``."""
    material = {"graph": digest, "candidates": candidates}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


# Each file's trouble is said once a process: it was read and written at every graph's race, and
# a cache directory that was a regular file gave seven warnings (wave 41).
_warned: set[str] = set()


def warn_once(file: Path, message: str, *args: Any) -> None:
    """``message`` (``%s`` first: the file) at WARNING, once a process for each file."""
    if str(file) not in _warned:
        _warned.add(str(file))
        logger.warning(message, file, *args)


class _Unusable(Exception):
    """A results file that exists but is not one ortrain can read: left as it is."""


def _read(file: Path) -> dict[str, Any]:
    try:
        payload = json.loads(file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warn_once(file, "ignoring the unreadable tuning results file %s (%s); tuning again", error)
        raise _Unusable from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        warn_once(file, "ignoring %s: not a tuning results file of format %d (left as it is)", FORMAT)
        raise _Unusable
    entries = payload.get("entries")
    return entries if isinstance(entries, dict) else {}


def load_choice(path: Path, key: str) -> str | None:
    """The placement name recorded for ``key``, or None."""
    try:
        entry = _read(results_file(path)).get(key)
    except _Unusable:
        return None
    return entry.get("placement") if isinstance(entry, dict) else None


def save_choice(path: Path, key: str, placement: str, *, graph: str, measured_ms: dict[str, float]) -> None:
    file = results_file(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    try:
        entries = _read(file)
    except _Unusable:
        return  # the user's file, not ours: not overwritten (it was, until wave 41)
    entries[key] = {
        "placement": placement,
        "graph": graph,
        "measured_ms": {name: round(ms, 3) for name, ms in measured_ms.items()},
        "machine": machine(),
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    payload = json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True)
    handle, temporary = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(payload + "\n")
        os.replace(temporary, file)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
