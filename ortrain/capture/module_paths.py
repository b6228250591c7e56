"""Label every captured node with the submodule that produced it.

AOTAutograd's joint graph carries no ``nn_module_stack`` when a plain module is traced, so the
memory optimizer could not tell which transformer layer a saved activation belongs to. While
capturing, a global forward pre-hook enters ``torch.fx.traceback.annotate`` with the running
submodule's qualified name; nodes then carry it in ``node.meta["custom"][MODULE_KEY]``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback

MODULE_KEY = "ortrain_module"

# The first numbered component of a path is a layer of a repeated stack: "blocks.3.mlp.0" -> "blocks.3".
_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def module_path(node: torch.fx.Node) -> str:
    return (node.meta.get("custom") or {}).get(MODULE_KEY, "")


def layer_of(path: str) -> str | None:
    match = _LAYER.match(path)
    return match.group(1) if match else None


@contextlib.contextmanager
def annotate_module_paths(root: torch.nn.Module) -> Iterator[None]:
    names = {id(m): name for name, m in root.named_modules()}
    active: list[contextlib.AbstractContextManager[None]] = []

    def enter(module: torch.nn.Module, _args: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        context = fx_traceback.annotate({MODULE_KEY: name})
        context.__enter__()
        active.append(context)

    def leave(module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if id(module) in names and active:
            active.pop().__exit__(None, None, None)

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        # A forward that raised never reached its post-hook: unwind what it left open.
        while active:
            active.pop().__exit__(None, None, None)
