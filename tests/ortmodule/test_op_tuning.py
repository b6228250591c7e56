"""Op tuning with ORTModule: a tuned model trains like eager PyTorch and like the untuned model,
and the choices round-trip through ORTMODULE_TUNING_RESULTS_PATH."""

from __future__ import annotations

import copy
import gc
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


# Every placement must be measured whatever the machine's load (the bound has its own test).
_NO_BOUND_MS = "600000"


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_tuning, "_chosen_in_process", {})


# ---- ORTModule with tuning on -------------------------------------------------------------------


def test_tuned_training_matches_eager_and_untuned_and_its_choices_round_trip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One tuning run serves both checks (a forced tuning of the MLP is most of this file's time).
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "1")
    monkeypatch.setenv("ORTMODULE_MAX_TUNING_DURATION_MS", _NO_BOUND_MS)
    monkeypatch.setenv("ORTMODULE_TUNING_RESULTS_PATH", str(tmp_path))  # a directory: the file goes in it
    model = _mlp()
    untuned_model = copy.deepcopy(model)
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, _batches(60), _mse)
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-4, atol=1e-5)
    assert_same_state(wrapped, eager)
    runners = _graphs(wrapped)
    assert all(isinstance(r, TunedRunner) and r.chosen is not None for r in runners)
    # every placement was really tried, on the real graphs
    assert {"onnxruntime", "all-torch"} <= set(runners[1].report)

    # The choices are in the results file, keyed per graph and machine.
    results = tmp_path / tuning_results.FILE_NAME
    payload = json.loads(results.read_text())
    entries = payload["entries"]
    assert payload["format"] == tuning_results.FORMAT and len(entries) == 2
    assert {e["graph"] for e in entries.values()} == {"forward", "backward"}
    assert {e["placement"] for e in entries.values()} == {r.chosen_placement.name for r in runners}
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

    # Untuned (no results file either), the same model trains to the same losses.
    monkeypatch.delenv("ORTMODULE_TUNING_RESULTS_PATH")
    losses_untuned, _, _, third = train_side_by_side(untuned_model, _batches(60), _mse)
    assert not any(isinstance(r, TunedRunner) for r in _graphs(third))
    torch.testing.assert_close(losses_ort, losses_untuned, rtol=1e-4, atol=1e-5)


def test_the_cache_directory_keeps_the_choices_unless_tuning_is_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ORTMODULE_CACHE_DIR without ORTMODULE_TUNING_RESULTS_PATH: the choices go in the cache and
    a later process builds only the chosen placement; an explicit path wins; tuning off reads none."""
    from ortrain.ortmodule.options import runtime_options

    cache = tmp_path / "cache"  # not made yet: the results file must not take its name
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(cache))
    monkeypatch.delenv("ORTMODULE_ENABLE_TUNING")
    assert runtime_options().tuning_results_path == cache / tuning_results.FILE_NAME
    monkeypatch.setenv("ORTMODULE_TUNING_RESULTS_PATH", str(tmp_path / "mine.json"))
    assert runtime_options().tuning_results_path == tmp_path / "mine.json"
    monkeypatch.delenv("ORTMODULE_TUNING_RESULTS_PATH")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    assert runtime_options().tuning_results_path is None

    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "1")
    monkeypatch.setenv("ORTMODULE_MAX_TUNING_DURATION_MS", _NO_BOUND_MS)
    _, _, _, first = train_side_by_side(_mlp(), _batches(60), _mse)
    chosen = {r.chosen_placement.name for r in _graphs(first)}
    entries = json.loads((cache / tuning_results.FILE_NAME).read_text())["entries"]
    assert {e["placement"] for e in entries.values()} == chosen

    monkeypatch.setattr(placement_tuning, "_chosen_in_process", {})  # a new process
    monkeypatch.delenv("ORTMODULE_ENABLE_TUNING")  # automatic, the default
    with caplog.at_level(logging.INFO, logger="ortrain.runtime"):
        losses, losses_eager, _, second = train_side_by_side(_mlp(), _batches(2), _mse)
    torch.testing.assert_close(losses, losses_eager, rtol=1e-4, atol=1e-5)
    assert not any(isinstance(r, TunedRunner) for r in _graphs(second))
    assert sum("read from" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize("policy", [None, "FALLBACK_DISABLE"], ids=["default-policy", "fallback-disabled"])
def test_the_first_steps_run_in_pytorch_and_onnxruntime_is_built_on_the_third(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, policy: str | None, compile_collections: list[bool]
) -> None:
    """Automatic tuning: the first two calls of a graph run all-torch (no export), ONNX Runtime's
    placement is built on the third, with the debug ONNX files; the losses are eager's throughout.
    A policy that forbids running in PyTorch what ONNX Runtime cannot run builds it at once.
    Built in the middle of a step, its garbage is collected as a capture's: the process's older
    objects frozen, not walked."""
    from ortrain import DebugOptions

    frozen_at_collection = compile_collections

    monkeypatch.delenv("ORTMODULE_ENABLE_TUNING")
    if policy is None:
        monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # this directory's tests forbid fallbacks
    else:
        monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", policy)
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    torch.manual_seed(0)
    # Big enough for a call to take more than the automatic mode's 2 ms on most machines.
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model, DebugOptions(save_onnx=True, onnx_prefix="lazy"))
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    for step in range(5):
        losses = []
        for module in (wrapped, eager):
            module.zero_grad()
            loss = nn.functional.mse_loss(module(x), y)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        assert_same_state(wrapped, eager)
        built = {r._candidates[0].runner is not None or r.chosen is not None for r in _graphs(wrapped)}
        saved = list(tmp_path.glob("lazy*.onnx"))
        if step == 0:
            frozen_at_collection.clear()  # the capture's own collection: the builds are checked
        if step == 0 and policy is None:
            assert built == {False} and not saved  # no export yet
        elif step >= 3 or policy is not None:
            # (all-torch's two warm-ups and first timing come first: the default is built on the
            # fourth call)
            assert built == {True} and saved, step
    assert frozen_at_collection == ([True, True] if policy is None else [])  # forward, backward
    assert gc.get_freeze_count() == 0


def test_a_results_file_of_another_format_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = tmp_path / "old.json"
    content = json.dumps({"format": 0, "entries": {"k": {"placement": "all-torch"}}})
    file.write_text(content)
    with caplog.at_level(logging.WARNING, logger="ortrain.runtime"):
        assert tuning_results.load_choice(file, "k") is None
        assert tuning_results.load_choice(file, "k") is None
        tuning_results.save_choice(file, "k2", "onnxruntime", graph="g", measured_ms={})
    # Said once, and the file is left as it is (wave 41: five warnings, then overwritten).
    assert caplog.text.count("not a tuning results file") == 1
    assert file.read_text() == content


# ---- a model that changes while it trains (and tunes) -------------------------------------------


class _Net(nn.Module):
    """Linear-Tanh-Linear: each graph races three placements (onnxruntime, all-torch, matmul in
    torch: tanh's backward is in no fused group), so a tuning finishes within a dozen steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_a_model_changed_mid_training_is_tuned_again_or_takes_its_recorded_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "1")
    monkeypatch.setenv("ORTMODULE_MAX_TUNING_DURATION_MS", _NO_BOUND_MS)
    model = _Net()
    model.encoder[0].requires_grad_(False)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    losses: list[tuple[float, float]] = []

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        pair = []
        for module in (wrapped, eager):
            module.zero_grad(set_to_none=True)
            loss = _mse(module, batch)
            loss.backward()
            with torch.no_grad():
                for p in module.parameters():
                    if p.grad is not None:
                        p -= 0.05 * p.grad
            pair.append(loss.item())
        losses.append((pair[0], pair[1]))

    def train_until_tuned(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, Any]]:
        for batch in batches:
            step(batch)
            if not any(g["tuning"] for g in wrapped.op_tuning()):
                break
        return wrapped.op_tuning()

    batches = iter(_batches(100))
    first = train_until_tuned([next(batches) for _ in range(45)])
    assert [g["graph"] for g in first] == ["forward", "backward"]
    assert all(not g["tuning"] and g["placement"] for g in first)

    # Unfreezing a layer gives a new backward graph (and forward: it saves more): tuned again, the
    # first capture's choices left as they were.
    for module in (wrapped, eager):
        module.encoder[0].requires_grad_(True)
    tuned = train_until_tuned([next(batches) for _ in range(45)])
    assert len(tuned) == 4 and tuned[:2] == first
    assert all(not g["tuning"] and g["placement"] for g in tuned[2:])
    assert {"onnxruntime", "all-torch"} <= set(tuned[3]["measured_ms"])  # really raced again
    assert wrapped.encoder[0].weight.grad is not None

    # A head swapped for one of the same shape drops every graph; the same graph captured again
    # takes the choice made for it, without tuning.
    head = nn.Linear(32, 4)
    with caplog.at_level(logging.INFO, logger="ortrain.runtime"):
        for module in (wrapped, eager):
            module.head = copy.deepcopy(head)
        for _ in range(3):
            step(next(batches))
    assert wrapped.op_tuning() == []
    for g in tuned[2:]:
        line = f"{g['graph']} graph: placement {g['placement']} (chosen earlier in this process)"
        assert line in caplog.text
    assert [name for name, _ in wrapped.graph_runners()] == ["forward", "backward"]

    ort_losses, eager_losses = zip(*losses, strict=True)
    torch.testing.assert_close(ort_losses, eager_losses, rtol=1e-4, atol=1e-5)
    assert_same_state(wrapped, eager)


class _ZeroDimConstants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, 0] = 0
        return (self.linear(x) * torch.tensor(2.0)).masked_fill(x > 1, torch.tensor(-1.0))


def test_a_graph_with_zero_dim_constants_is_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "1")
    torch.manual_seed(0)
    eager = _ZeroDimConstants()
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(4):
        x = torch.randn(3, 4)
        torch.testing.assert_close(wrapped(x), eager(x))
