"""TorchScript inside a model: a ``torch.jit.script`` function, a scripted submodule.

TorchScript's executor profiles a function's first calls and then runs an optimized plan in which
a differentiable stretch of ops is one opaque autograd node. A capture tracing such a plan saw its
output but not the ops behind it: the captured backward had no gradient for anything below the
scripted part, those parameters got ``None`` and never trained, silently (wave 29: a scripted GELU
after ``op tuning``'s eager first calls; the loss 0.1 off eager's after four steps). Turning
optimization off does not help a function already profiled: its plan is cached.

So while capturing, each call of a scripted function or method first drops its compiled plans and
then runs unoptimized: the interpreter runs the ops one by one through the dispatcher, and the
trace records them with their autograd. Eager calls after the capture profile again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_CALLABLES = (torch.jit.ScriptFunction, torch.ScriptMethod)


def _unoptimized(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(script: Any, *args: Any, **kwargs: Any) -> Any:
        script._debug_flush_compilation_cache()
        with torch.jit.optimized_execution(False):
            return original(script, *args, **kwargs)

    return call


@contextlib.contextmanager
def torchscript_unoptimized() -> Iterator[None]:
    """Within: TorchScript functions and methods run op by op, without cached optimized plans."""
    originals = [(kind, kind.__call__) for kind in _CALLABLES]
    for kind, original in originals:
        kind.__call__ = _unoptimized(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for kind, original in originals:
            kind.__call__ = original  # type: ignore[method-assign]
