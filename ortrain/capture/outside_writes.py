"""In-place writes a capture makes to real tensors outside the model, undone after it.

A capture traces the forward on fake and functional tensors, but a tensor the forward finds outside
the model (a momentum encoder kept in a plain list, a module-level counter) is real: its in-place
update (``target.mul_(m).add_(online, alpha=1 - m)`` under ``no_grad``) runs on it while the trace
runs, and a capture that then fails (such a model trains through TorchDynamo's graph breaks) left
it written, once per attempt: BYOL's target moved three times on the first step, the loss 0.109
where eager's was 0.058 (wave 49's review). While capturing, each real tensor an in-place operator
is about to write is copied once, and put back when the capture ends; the step that follows makes
the write, once, as eager does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

_state = threading.local()


@contextlib.contextmanager
def outside_writes_undone() -> Iterator[None]:
    """Within the block (a capture), real tensors written in place get their values back after it."""
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    previous = getattr(_state, "saved", None)
    _state.saved = saved
    try:
        yield
    finally:
        _state.saved = previous
        with torch.no_grad():
            for tensor, value in saved.values():
                if tensor.shape != value.shape:  # sized by the write (an observer's ``resize_``)
                    tensor.resize_(value.shape)
                tensor.copy_(value)


def _is_real(value: Any) -> bool:
    # Fake and functional tensors are subclasses: a real one is exactly a Tensor or a Parameter.
    # torch.func's batched and grad-tracking wrappers are of that exact type too, but live only
    # inside their transform: one written there (an in-place op under ``vmap(grad(f))``) is not
    # outside the model, and writing its value back after the transform ended raises.
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.device.type != "meta"
        and not torch._C._functorch.is_functorch_wrapped_tensor(value)
    )


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    name = getattr(func, "__name__", "")
    written = list(kwargs["out"]) if isinstance(kwargs.get("out"), list | tuple) else [kwargs.get("out")]
    if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
        first = args[0] if args else None
        written += list(first) if isinstance(first, list | tuple) else [first]  # torch._foreach_*_
    return written


def note_write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before ``func`` runs under a capture: keep the values of the real tensors it writes."""
    saved = getattr(_state, "saved", None)
    if saved is None:
        return
    for tensor in _written(func, args, kwargs):
        if _is_real(tensor) and id(tensor) not in saved:
            saved[id(tensor)] = (tensor, tensor.detach().clone())
