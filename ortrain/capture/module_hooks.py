"""Forward hooks that must not run while a module is traced, set aside for the capture.

DeepSpeed ZeRO-3 hooks every submodule to all-gather its partitioned parameters before its forward
and partition them after; traced, those hooks meet fake tensors (no ``ds_status``) and would put
collectives in the graph. ORTModule gathers the parameters itself around each graph
(:mod:`ortrain.ortmodule.zero3`), so while capturing, the hooks a predicate picks are removed from
every module and put back afterwards, in their order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
BACKWARD_HOOK_DICTS = ("_backward_pre_hooks", "_backward_hooks")
# Hooks of PyTorch and of the libraries ortrain works with act within the call, and are captured
# (see ortrain/ortmodule/forward_hooks.py); the user's own must run at every step.
_LIBRARIES = ("torch.", "transformers.", "accelerate.", "peft.", "deepspeed.", "ortrain.")


def is_users_hook(hook: Any) -> bool:
    home = getattr(hook, "__module__", None) or getattr(type(hook), "__module__", "") or ""
    return not home.startswith(_LIBRARIES)


def has_users_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a forward (pre-)hook or a full backward (pre-)hook of the user's."""
    return any(
        is_users_hook(hook)
        for name in (*FORWARD_HOOK_DICTS, *BACKWARD_HOOK_DICTS)
        for hook in getattr(module, name).values()
    )


@contextlib.contextmanager
def hooks_set_aside(module: nn.Module, picked: Callable[[Any], bool]) -> Iterator[None]:
    """Within the block, the forward (pre-)hooks of ``module`` and its submodules for which
    ``picked(hook)`` holds do not run."""
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for sub in module.modules():
            for name in FORWARD_HOOK_DICTS:
                hooks = getattr(sub, name)
                if any(picked(hook) for hook in hooks.values()):
                    saved.append((sub, name, hooks))
                    kept = type(hooks)((k, h) for k, h in hooks.items() if not picked(h))
                    object.__setattr__(sub, name, kept)
        yield
    finally:
        for sub, name, hooks in saved:
            object.__setattr__(sub, name, hooks)


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running has finished (from a backward only)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
