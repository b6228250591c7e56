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
import threading
from collections.abc import Iterator
from typing import Any

from ortrain.capture.model_code import model_code_calling


class EnvironmentReadError(RuntimeError):
    """The model's forward read an environment variable while it was captured."""


@contextlib.contextmanager
def environment_reads_refused() -> Iterator[None]:
    """Within the block (a capture, on this thread), the model's reads of ``os.environ`` raise."""
    environ_class = type(os.environ)
    original = environ_class.__getitem__
    thread = threading.get_ident()

    def getitem(self: Any, key: str) -> Any:
        where = model_code_calling(2) if self is os.environ and threading.get_ident() == thread else None
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
