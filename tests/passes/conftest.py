import pytest


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests of the ONNX Runtime path must fail, not fall back to PyTorch, when the path breaks."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
