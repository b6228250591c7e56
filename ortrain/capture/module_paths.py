"""Label every captured node with the submodule that produced it, and note the modules the
forward calls that the model does not hold.

AOTAutograd's joint graph carries no ``nn_module_stack`` when a plain module is traced, so the
memory optimizer could not tell which transformer layer a saved activation belongs to. While
capturing, a global forward pre-hook records the running submodule's qualified name in
``torch.fx.traceback``'s current node meta; nodes then carry it in ``node.meta["custom"][MODULE_KEY]``.

The same hook sees the modules called that are not submodules of the model (kept in a plain list
or dict to stay out of ``parameters()``: a frozen teacher, a helper; a module-level one). Their
hooks are in no key of the model's: one of the user's, traced, would run once on fake tensors and
never again, and one added later went unseen (wave 49's review: a forward hook tripling a
helper's output changed nothing). Such a module with the user's hooks fails the capture with
:class:`UnheldModuleHooksError` (the model then trains through TorchDynamo's graph breaks, which
run hooks at every step), and the ones without are listed for the wrapper to watch: for hooks, and
(wave 52) for their plain attributes and ``training`` flag, which the graph bakes in like a
submodule's (``GraphKey.unheld``).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback

from ortrain.capture.module_hooks import has_users_hooks

MODULE_KEY = "ortrain_module"

# The first numbered component of a path is a layer of a repeated stack: "blocks.3.mlp.0" -> "blocks.3".
# The ids of the global hooks above while a capture runs: not the user's, so not part of any
# model's key (ortrain.ortmodule.guards.global_hook_ids). Another thread's model saw them come
# and go, and two threads training their own models captured again at every step (wave 43).
CAPTURE_HOOK_IDS: set[int] = set()
_COMPILED_MODULE_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"

_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


class UnheldModuleHooksError(RuntimeError):
    """The forward called a module the model does not hold, and it has hooks of the user's."""


def module_path(node: torch.fx.Node) -> str:
    return (node.meta.get("custom") or {}).get(MODULE_KEY, "")


def layer_of(path: str) -> str | None:
    match = _LAYER.match(path)
    return match.group(1) if match else None


def _set_path(path: str | None) -> None:
    # torch.fx.traceback.current_meta is rebound by preserve_node_meta: read the global each time
    meta = fx_traceback.current_meta
    if path is None:
        custom = meta.get("custom")
        if custom is not None:
            custom.pop(MODULE_KEY, None)
            if not custom:
                del meta["custom"]
    else:
        meta.setdefault("custom", {})[MODULE_KEY] = path


@contextlib.contextmanager
def annotate_module_paths(root: torch.nn.Module) -> Iterator[dict[int, torch.nn.Module]]:
    """Nodes traced inside carry the running submodule's path (``meta["custom"][MODULE_KEY]``);
    yields the table (by id) the modules called that ``root`` does not hold are added to (see the module).

    The path is written into ``torch.fx.traceback``'s current meta directly rather than through
    nested ``annotate`` contexts: a forward that raises inside a trace never reaches its
    post-hook, and an ``annotate`` left open there would later be closed against the meta that
    an enclosing ``preserve_node_meta`` restored (a KeyError masking the real error).
    """
    names = {id(m): name for name, m in root.named_modules()}
    active: list[tuple[int, str]] = []
    unheld: dict[int, torch.nn.Module] = {}

    def enter(module: torch.nn.Module, _args: Any) -> None:
        name = names.get(id(module))
        if name is None:
            if has_users_hooks(module):  # before the module's own hooks run
                raise UnheldModuleHooksError(
                    f"the forward calls a {type(module).__name__} that the model does not hold as a "
                    "submodule, and it has hooks of the user's"
                )
            # Not the graph modules the capture's own tracing runs (AOTAutograd's traced forward,
            # one per capture, kept alive by its graphs): watched, each made the key of the next.
            if not isinstance(module, torch.fx.GraphModule):
                unheld.setdefault(id(module), module)
            return
        active.append((id(module), name))
        _set_path(name)

    def leave(module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if not any(key == id(module) for key, _ in active):
            return
        # Entries above this module's are forwards that raised inside it: drop them with it.
        while active and active.pop()[0] != id(module):
            pass
        _set_path(active[-1][1] if active else None)

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    CAPTURE_HOOK_IDS.update((pre.id, post.id))
    try:
        with warnings.catch_warnings():
            # A torch.compile'd submodule warns that global hooks fire twice: these are ortrain's
            # own, and twice only writes the same path twice.
            warnings.filterwarnings("ignore", message=_COMPILED_MODULE_HOOK_WARNING)
            yield unheld
    finally:
        pre.remove()
        post.remove()
        CAPTURE_HOOK_IDS.difference_update((pre.id, post.id))
        if active:
            active.clear()
            _set_path(None)
