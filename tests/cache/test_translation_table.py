"""The operator-translation answers kept in ORTMODULE_CACHE_DIR: the same as torch.onnx's, read
back by a later process, and a corrupt entry is rebuilt."""

from __future__ import annotations

import logging
import operator
from pathlib import Path

import pytest
import torch

from ortrain.cache import translation_table
from ortrain.cache.store import CacheStore
from ortrain.cache.translation_table import TranslationTable
from ortrain.export import onnx_translations

aten = torch.ops.aten
# Translated directly, through a decomposition, and not at all (as far as torch.onnx knows).
_TARGETS = [aten.mm.default, aten.gelu_backward.default, aten._linalg_eigh.default, operator.getitem]


def _answers(table: TranslationTable) -> list[tuple[bool, bool]]:
    return [(table.has_onnx_translation(t), table.decomposed_at_export(t)) for t in _TARGETS]


def test_answers_match_torch_onnx_and_are_read_back_without_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = [
        (onnx_translations.has_onnx_translation(t), onnx_translations.decomposed_at_export(t))
        for t in _TARGETS
    ]
    first = TranslationTable(tmp_path)
    assert _answers(first) == expected
    assert expected[:3] == [(True, False), (True, True), (False, False)]  # the three cases
    first.save()
    entries = [e for e in CacheStore(tmp_path).entries() if e.header.get("kind") == translation_table.KIND]
    assert len(entries) == 1 and entries[0].header["nodes"] == len(_TARGETS)

    # A later process: no registry built, no torch.onnx look-up at all.
    def forbidden(*_args: object) -> bool:
        raise AssertionError("looked up in torch.onnx")

    monkeypatch.setattr(onnx_translations, "_OP_REGISTRIES", {})
    monkeypatch.setitem(translation_table._QUESTIONS, "has_onnx_translation", forbidden)
    monkeypatch.setitem(translation_table._QUESTIONS, "decomposed_at_export", forbidden)
    assert _answers(TranslationTable(tmp_path)) == expected
    assert onnx_translations._OP_REGISTRIES == {}


def test_user_operators_are_not_remembered(tmp_path: Path) -> None:
    library = torch.library.Library("ortrain_test_tt", "DEF")  # a throwaway operator
    library.define("twice(Tensor x) -> Tensor")
    table = TranslationTable(tmp_path)
    assert not table.has_onnx_translation(torch.ops.ortrain_test_tt.twice.default)
    table.save()  # nothing remembered: nothing written
    assert list(CacheStore(tmp_path).entries()) == []


def test_corrupt_entry_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = TranslationTable(tmp_path)
    expected = _answers(table)
    table.save()
    (entry,) = CacheStore(tmp_path).entries()
    data = bytearray(entry.path.read_bytes())
    data[-3] ^= 0xFF
    entry.path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        again = TranslationTable(tmp_path)
        assert _answers(again) == expected
    assert "is corrupt" in caplog.text
    again.save()
    assert _answers(TranslationTable(tmp_path)) == expected
