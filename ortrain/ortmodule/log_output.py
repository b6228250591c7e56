"""Where ortrain's log lines go when the training script has not configured logging.

ortrain logs through ``logging.getLogger("ortrain...")``. A script that never configures logging
has no handler, and Python's last resort prints warnings only: ``ORTMODULE_LOG_LEVEL=INFO`` or
``ORTMODULE_PRINT_INPUT_DENSITY=1`` printed nothing at all (wave 15). So ortrain's logger gets one
handler of its own that writes to standard error, and stays silent as soon as the application has
given the root logger a handler (``logging.basicConfig``, a framework's setup, pytest), so that
no line is printed twice. The inspector's tables (``ORTMODULE_PRINT_*``) are INFO lines of
``ortrain.inspector``, shown whatever ``ORTMODULE_LOG_LEVEL`` says.
"""

from __future__ import annotations

import logging
import sys

_FORMAT = "[ortrain %(levelname)s] %(message)s"


class _UnlessConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to standard error while the root logger has no handler."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            # The stream looked up at each line, as the last resort does: a replaced sys.stderr
            # (a notebook, a test's capture) gets it.
            self.stream = sys.stderr
            super().emit(record)


def configure_log_output(level: int, *, inspector_prints: bool) -> None:
    """``level`` for the ``ortrain`` loggers; ``inspector_prints``: the inspector's INFO tables
    show even above INFO."""
    root = logging.getLogger("ortrain")
    root.setLevel(level)
    if not any(isinstance(h, _UnlessConfigured) for h in root.handlers):
        root.addHandler(_UnlessConfigured())
    logging.getLogger("ortrain.inspector").setLevel(
        min(level, logging.INFO) if inspector_prints else logging.NOTSET
    )
