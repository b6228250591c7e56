"""The environment variables a forward reads, with the values a capture saw.

A captured graph holds the branch the variable chose while it was traced
(``self.b(h) if os.getenv("HEAD") == "b" else self.a(h)``): a flip between steps kept training the
captured head, the other one silently without gradients (wave 49's review). While capturing, every
read of ``os.environ`` from the model's own code (``os.environ[...]``, ``.get``, ``os.getenv``,
``in``: all go through ``__getitem__``) is recorded with the value it got (None: unset), and the
wrapper keeps the graph under those values (``GraphKey.environment``): another value captures again.

Until wave 52 such a read failed the capture and sent the model to TorchDynamo's graph breaks,
which guard ``os.environ.get`` and ``os.environ[...]`` but neither ``os.getenv`` nor ``in``
(torch 2.13): the first step's branch stayed, silently. Reads by PyTorch, ortrain and installed
libraries while tracing are theirs, and are not recorded.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from ortrain.capture.model_code import model_code_calling


@contextlib.contextmanager
def environment_reads_recorded() -> Iterator[dict[str, str | None]]:
    """Within the block (a capture, on this thread), the model's reads of ``os.environ``: the
    yielded dict maps each variable read to the value the first read got (None where unset)."""
    environ_class = type(os.environ)
    original = environ_class.__getitem__
    thread = threading.get_ident()
    reads: dict[str, str | None] = {}

    def getitem(self: Any, key: str) -> Any:
        if self is not os.environ or threading.get_ident() != thread or model_code_calling(2) is None:
            return original(self, key)
        try:
            value = original(self, key)
        except KeyError:
            reads.setdefault(key, None)
            raise
        reads.setdefault(key, value)
        return value

    environ_class.__getitem__ = getitem  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        environ_class.__getitem__ = original  # type: ignore[method-assign]
