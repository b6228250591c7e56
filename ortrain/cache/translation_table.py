"""Which ATen operators torch.onnx translates, remembered in ``ORTMODULE_CACHE_DIR``.

The ONNX Runtime executor claims a node when torch.onnx has a translation for its operator; the
first such question in a process imports torchlib and builds the registry entries of the
operators asked about (0.3-0.6 s on the 2-core machine; the whole registry took 1.1 s before it
was built lazily), which a warm cache would otherwise pay although it exports nothing. The
answers depend only on the operator and on the installed torch / onnxscript and ortrain's export
code, so they are stored in one entry keyed by those versions and that code (a new version reads
a new entry) and answered from it in later processes; an operator not in it is looked up and
added.

Only ``aten`` and ``prims`` operators and Python's ``operator`` functions are remembered: a
user's own operator may gain a decomposition at run time, and its name need not stand for the
same operator in another process. Were an answer ever wrong, it could only move a node between
executors (an export that fails hands it to PyTorch; a refused one runs in PyTorch), never
change what is computed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ortrain.cache.graph_key import export_code_hash, versions
from ortrain.cache.store import CacheStore
from ortrain.export import onnx_translations

logger = logging.getLogger("ortrain.cache")
KIND = "translations"
_REMEMBERED_NAMESPACES = ("aten", "prims")
_REMEMBERED_MODULES = ("_operator", "math")


def _key() -> str:
    material = {"kind": KIND, "format": 1, "versions": versions(), "export_code": export_code_hash()}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _name(target: Any) -> str | None:
    """The name an answer is remembered under, or None for an operator that is not remembered."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace in _REMEMBERED_NAMESPACES:
        return str(target)
    if getattr(target, "__module__", None) in _REMEMBERED_MODULES:  # getitem, size arithmetic
        return f"{target.__module__}.{target.__qualname__}"
    return None


_QUESTIONS = {
    "has_onnx_translation": onnx_translations.has_onnx_translation,
    "decomposed_at_export": onnx_translations.decomposed_at_export,
}


class TranslationTable:
    """``has_onnx_translation`` and ``decomposed_at_export``, answered from the cache first."""

    def __init__(self, cache_dir: Path | None) -> None:
        self._store = CacheStore(cache_dir) if cache_dir is not None else None
        # operator name -> {question: answer}; each question is asked only when needed (the
        # second one costs 0.2 s more the first time).
        self._answers: dict[str, dict[str, bool]] = self._load()
        self._unsaved = False

    def _load(self) -> dict[str, dict[str, bool]]:
        if self._store is None:
            return {}
        payload = self._store.load(KIND, _key())
        if payload is None:
            return {}
        try:
            loaded = json.loads(payload)
            return {
                str(name): {q: bool(a) for q, a in answers.items() if q in _QUESTIONS}
                for name, answers in loaded.items()
            }
        except (ValueError, TypeError, AttributeError) as error:
            logger.warning(
                "cache entry %s cannot be read (%s); rebuilding it", self._store.path(KIND, _key()), error
            )
            return {}

    def _answer(self, question: str, target: Any) -> bool:
        name = _name(target)
        answers = self._answers.setdefault(name, {}) if name is not None else {}
        if question not in answers:
            answers[question] = _QUESTIONS[question](target)
            self._unsaved = self._unsaved or name is not None
        return answers[question]

    def has_onnx_translation(self, target: Any) -> bool:
        return self._answer("has_onnx_translation", target)

    def decomposed_at_export(self, target: Any) -> bool:
        return self._answer("decomposed_at_export", target)

    def save(self) -> None:
        """Store the answers learned since the last save, merged with what another process stored."""
        if self._store is None or not self._unsaved:
            return
        merged = self._load()
        for name, answers in self._answers.items():
            merged.setdefault(name, {}).update(answers)
        payload = json.dumps(merged, sort_keys=True).encode()
        header = {"what": "op translations", "nodes": len(merged), "versions": versions()}
        if self._store.save(KIND, _key(), payload, header):
            self._answers = merged
            self._unsaved = False


@functools.cache
def translation_table(cache_dir: Path | None) -> TranslationTable:
    """The process's table for ``cache_dir`` (None: answers kept in memory only)."""
    return TranslationTable(cache_dir)
