"""Op tuning with ORTModule: a tuned model trains like eager PyTorch and like the untuned model,
and the choices round-trip through ORTMODULE_TUNING_RESULTS_PATH."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn

from ortrain import ORTModule
from ortrain.runtime import placement_tuning, tuning_results
from ortrain.runtime.placement_tuning import TunedRunner


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _batches(n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(n)]


def _mse(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(module(batch[0]), batch[1])


def _graphs(model: ORTModule) -> list[Any]:
    return [runner for _, runner in model.graph_runners()]


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_tuning, "_chosen_in_process", {})


# ---- ORTModule with tuning on -------------------------------------------------------------------


def test_tuned_training_matches_eager_and_untuned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "1")
    monkeypatch.setenv("ORTMODULE_TUNING_RESULTS_PATH", str(tmp_path))
    model = _mlp()
    untuned_model = copy.deepcopy(model)
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, _batches(30), _mse)
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-4, atol=1e-5)
    assert_same_state(wrapped, eager)
    runners = _graphs(wrapped)
    assert all(isinstance(r, TunedRunner) and r.chosen is not None for r in runners)
    # every placement was really tried, on the real graphs
    assert {"onnxruntime", "all-torch"} <= set(runners[1].report)

    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    monkeypatch.delenv("ORTMODULE_TUNING_RESULTS_PATH")
    losses_untuned, _, _, _ = train_side_by_side(untuned_model, _batches(30), _mse)
    torch.testing.assert_close(losses_ort, losses_untuned, rtol=1e-4, atol=1e-5)


def test_results_file_round_trip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "1")
    results = tmp_path / "tuning.json"
    monkeypatch.setenv("ORTMODULE_TUNING_RESULTS_PATH", str(results))
    _, _, _, first = train_side_by_side(_mlp(), _batches(30), _mse)
    chosen = {r.chosen_placement.name for r in _graphs(first)}
    payload = json.loads(results.read_text())
    entries = payload["entries"]
    assert payload["format"] == tuning_results.FORMAT and len(entries) == 2
    assert {e["graph"] for e in entries.values()} == {"forward", "backward"}
    assert {e["placement"] for e in entries.values()} == chosen
    assert all(e["machine"]["threads"] == torch.get_num_threads() for e in entries.values())

    # A new process (no choices in memory), tuning off: the recorded placements are used as they are.
    monkeypatch.setattr(placement_tuning, "_chosen_in_process", {})
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    with caplog.at_level(logging.INFO, logger="ortrain.runtime"):
        losses, losses_eager, _, second = train_side_by_side(_mlp(), _batches(2), _mse)
    torch.testing.assert_close(losses, losses_eager, rtol=1e-4, atol=1e-5)
    assert not any(isinstance(r, TunedRunner) for r in _graphs(second))
    read = [r.getMessage() for r in caplog.records if f"read from {results}" in r.getMessage()]
    assert len(read) == 2


def test_a_results_file_of_another_format_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = tmp_path / "old.json"
    file.write_text(json.dumps({"format": 0, "entries": {"k": {"placement": "all-torch"}}}))
    with caplog.at_level(logging.WARNING, logger="ortrain.runtime"):
        assert tuning_results.load_choice(file, "k") is None
    assert "not an ortrain tuning results file" in caplog.text
