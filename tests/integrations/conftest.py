from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests of the ONNX Runtime path must fail, not fall back to PyTorch, when the path breaks."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export_cache")


@pytest.fixture(autouse=True)
def _shared_export_cache(monkeypatch: pytest.MonkeyPatch, export_cache: Path) -> None:
    """These tests wrap the same tiny GPT-2 again and again (a resumed Trainer wraps a new model;
    both Trainer tests evaluate the same inference graph), and exporting is most of their time:
    each graph is exported once, then read from ORTMODULE_CACHE_DIR, which CI users also set. The
    cache's own correctness (keys, hits, misses, stale entries) is tested in tests/cache/."""
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(export_cache))
