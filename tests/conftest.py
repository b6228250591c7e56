import pytest


@pytest.fixture(autouse=True)
def _no_automatic_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests inspect the plan they train with; automatic op tuning would swap it mid-test for the
    placement that measures fastest on the machine. Tuning's own tests set the variable back."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
