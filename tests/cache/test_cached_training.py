"""ORTModule with ORTMODULE_CACHE_DIR: a warm cache skips every export and trains bit-identically."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.cache import translation_table
from ortrain.cache.store import CacheStore
from ortrain.export import onnx_translations
from ortrain.runtime import startup_timings


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


def _start() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6))
    # Batch size 4, then 7: the second capture has a symbolic size (formulas go through the cache).
    return model, [torch.randn(4, 6), torch.randn(7, 6), torch.randn(4, 6)]


def _train(
    model: nn.Module, batches: list[torch.Tensor]
) -> tuple[list[float], list[torch.Tensor], list[str]]:
    startup_timings.RECORDED.clear()
    wrapped = ORTModule(copy.deepcopy(model))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in batches:
        loss = (wrapped(x) - x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stages = [t.stage for t in startup_timings.RECORDED if t.stage.startswith("export")]
    return losses, [p.detach().clone() for p in wrapped.parameters()], stages


def _exports(cache: Path) -> list[object]:
    return [e for e in CacheStore(cache).entries() if e.header.get("kind") == "export"]


def _assert_identical(run: tuple, reference: tuple) -> None:
    assert run[0] == reference[0]  # bit-identical losses
    assert all(torch.equal(a, b) for a, b in zip(run[1], reference[1], strict=True))


def test_cache_cold_warm_corrupt_and_unwritable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, batches = _start()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        uncached = _train(model, batches)
    assert [r.message.count("running uncached") for r in caplog.records] == [1]  # one warning, 4 exports
    assert uncached[2] == ["export"] * 4

    cache = tmp_path / "cache"
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(cache))
    cold = _train(model, batches)
    assert cold[2] == ["export"] * 4 and len(_exports(cache)) == 4
    _assert_identical(cold, uncached)

    # As in a new process: no op registry, no translation answers in memory. A warm cache
    # answers which nodes ONNX Runtime claims from its stored table: torch.onnx's op registry
    # (1.1 s to build) is never built.
    monkeypatch.setattr(onnx_translations, "_OP_REGISTRIES", {})
    translation_table.translation_table.cache_clear()
    warm = _train(model, batches)
    assert warm[2] == ["export (cached)"] * 4  # nothing exported
    assert onnx_translations._OP_REGISTRIES == {}
    _assert_identical(warm, uncached)

    for entry in _exports(cache):  # damage every entry: each is rebuilt, never loaded
        data = bytearray(entry.path.read_bytes())
        data[-10] ^= 0xFF
        entry.path.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        rebuilt = _train(model, batches)
    assert rebuilt[2] == ["export"] * 4 and caplog.text.count("is corrupt") == 4
    _assert_identical(rebuilt, uncached)
    assert _train(model, batches)[2] == ["export (cached)"] * 4


def test_warm_cache_gpt_with_label_sparsity_is_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SFT GPT's graphs hold data-dependent sizes (the count of scored labels)."""
    from ortrain import bench

    model, batch = bench.build_model("sft", bench.QUICK)
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    runs = []
    for _ in range(2):
        startup_timings.RECORDED.clear()
        wrapped = ORTModule(copy.deepcopy(model))
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            loss = wrapped(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        stages = [t.stage for t in startup_timings.RECORDED if t.stage.startswith("export")]
        runs.append((losses, [p.detach().clone() for p in wrapped.parameters()], stages))
    assert runs[0][2] == ["export"] * 2 and runs[1][2] == ["export (cached)"] * 2
    assert runs[1][0] == runs[0][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[1][1], runs[0][1], strict=True))


def test_a_dynamic_capture_from_the_cache_keeps_its_size_guards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, truncating_model: type[nn.Module]
) -> None:
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    for warm in (False, True):
        startup_timings.RECORDED.clear()
        eager = truncating_model()
        wrapped = ORTModule(copy.deepcopy(eager))
        torch.manual_seed(1)
        for length in (8, 12, 20):
            x = torch.randn(2, length, 4)
            losses = [module(x) for module in (wrapped, eager)]
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6, msg=f"length {length}")
        loaded = [t for t in startup_timings.RECORDED if t.stage == "capture (cached)"]
        assert len(loaded) == (3 if warm else 0)
        assert len(wrapped._ortrain_graphs) == 3


def test_a_cache_directory_that_is_a_file_is_said_once_with_tuning_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With op tuning on, the tuning results file under an unusable cache directory warned again,
    at every race (wave 41: seven warnings where the README promises one)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(blocker))
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "1")
    model = ORTModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(30):
            model(torch.randn(5, 4)).sum().backward()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(blocker) in warnings[0], warnings
