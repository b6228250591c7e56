import pytest


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests of the ONNX Runtime path must fail, not fall back to PyTorch, when the path breaks."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


@pytest.fixture(autouse=True)
def _shared_export_cache(shared_export_cache: None) -> None:
    """The Trainer tests wrap the same tiny GPT-2 again and again (a resumed Trainer wraps a new
    model; both tests train and evaluate the same graphs): see tests/conftest.py."""
