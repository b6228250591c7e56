"""A forward that reads an environment variable is not captured whole.

A captured graph holds the branch the variable chose while it was traced
(``self.b(h) if os.environ.get("HEAD") == "b" else self.a(h)``), and no guard watches the
environment: a flip between steps kept training the captured head, the other one silently
without gradients (wave 49's review). TorchDynamo guards such reads, so while capturing, a read of
``os.environ`` (``os.environ[...]``, ``.get``, ``os.getenv``, ``in``) from the model's own code fails
the capture with :class:`EnvironmentReadError`, and the model trains through the graph-break
path. Reads by PyTorch, ortrain and installed libraries while tracing are theirs, and pass.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_STDLIB = sysconfig.get_paths()["stdlib"]
_ORTRAIN = str(Path(__file__).resolve().parents[1])
_INSTALLED = ("site-packages", "dist-packages")


class EnvironmentReadError(RuntimeError):
    """The model's forward read an environment variable while it was captured."""


def _model_code_reading() -> str | None:
    """Where the model's own code reads ``os.environ`` (``file:line``), or None where the reader
    is PyTorch's, ortrain's, an installed library's or the standard library's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith((_STDLIB, "<frozen ")):
        frame = frame.f_back  # os.getenv, Mapping.get (``<frozen os>`` where Python froze them)
    if frame is None:
        return None
    filename = frame.f_code.co_filename
    if filename.startswith(("<", _ORTRAIN)) or any(part in filename for part in _INSTALLED):
        return None
    return f"{filename}:{frame.f_lineno}"


@contextlib.contextmanager
def environment_reads_refused() -> Iterator[None]:
    """Within the block (a capture, on this thread), the model's reads of ``os.environ`` raise."""
    environ_class = type(os.environ)
    original = environ_class.__getitem__
    thread = threading.get_ident()

    def getitem(self: Any, key: str) -> Any:
        where = _model_code_reading() if self is os.environ and threading.get_ident() == thread else None
        if where is not None:
            raise EnvironmentReadError(
                f"the forward reads the environment variable {key!r} ({where}), which a captured "
                "graph would hold at its value now"
            )
        return original(self, key)

    environ_class.__getitem__ = getitem  # type: ignore[method-assign]
    try:
        yield
    finally:
        environ_class.__getitem__ = original  # type: ignore[method-assign]
