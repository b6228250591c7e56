"""``print`` in a forward captured whole: it runs while ortrain traces, and a warning says once
that the captured graph will not print."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.capture import print_calls


class _Chatty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        print("activation", tuple(h.shape))
        return h.sum()


def test_a_print_in_the_forward_is_warned_about_once(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It printed traced values at capture, then never again, without a word (wave 50's review)."""
    monkeypatch.setattr(print_calls, "_warned", set())  # once per process: this test's own
    wrapped = ORTModule(_Chatty())
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for rows in (3, 3, 5, 6):
            wrapped(torch.randn(rows, 4)).backward()
    warnings = [r.getMessage() for r in caplog.records if "print() in the forward" in r.getMessage()]
    assert len(warnings) == 1 and "test_print_calls.py" in warnings[0]
    assert "activation" in capsys.readouterr().out  # the user's print still ran, while tracing


def test_prints_outside_a_capture_are_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    import builtins

    before = builtins.print
    ORTModule(_Chatty())(torch.randn(2, 4)).backward()
    assert builtins.print is before
    print("after")
    assert capsys.readouterr().out.endswith("after\n")
