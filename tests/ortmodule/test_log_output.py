"""ortrain's log lines reach a script that never configured logging, once, and only those asked for."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ortrain import ORTModule, bench


@contextlib.contextmanager
def root_handlers(*handlers: logging.Handler) -> Iterator[None]:
    """The root logger with just ``handlers`` (none: as a plain script has it), within the test's
    call, where pytest has added its own."""
    root = logging.getLogger()
    kept = root.handlers
    root.handlers = list(handlers)
    try:
        yield
    finally:
        root.handlers = kept


def _train_sft(steps: int = 2) -> ORTModule:
    model, batch = bench.build_model("sft", bench.QUICK)  # half the labels -100, head fused with its loss
    wrapped = ORTModule(model)
    for _ in range(steps):
        wrapped(*batch).backward()
    return wrapped


def test_log_level_info_prints_without_logging_configured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Until wave 15 ORTMODULE_LOG_LEVEL=INFO printed nothing: Python's last resort shows warnings only."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    with root_handlers():
        wrapped = ORTModule(nn.Linear(3, 2))
        wrapped(torch.randn(4, 3)).sum().backward()
    err = capsys.readouterr().err
    assert "[ortrain INFO] capturing a graph: first call" in err
    assert err.count("capturing a graph: first call") == 1


def test_input_density_prints_at_the_default_log_level(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ORTMODULE_PRINT_INPUT_DENSITY=1 alone prints its tables (and no other INFO line); the labels
    of a head fused with its loss are found (wave 15: no figure at all, by default)."""
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    monkeypatch.delenv("ORTMODULE_LOG_LEVEL", raising=False)
    with root_handlers():
        wrapped = _train_sft()
    err = capsys.readouterr().err
    assert "[ortrain INFO] input density at step 1" in err
    assert "| 1 | targets | - | 50.00% |" in err
    assert "capturing" not in err
    assert [r.label_density for r in wrapped.inspector.input_density.records] == [0.5, 0.5]


def test_configured_logging_gets_each_line_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a handler on the root logger (basicConfig, a framework), ortrain's own stays silent."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    with root_handlers(Collect()):
        wrapped = ORTModule(nn.Linear(3, 2))
        wrapped(torch.randn(4, 3)).sum().backward()
    assert "[ortrain" not in capsys.readouterr().err
    assert seen.count("capturing a graph: first call") == 1
