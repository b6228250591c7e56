"""A non-reentrant ``torch.utils.checkpoint`` around a model on the graph-break path: recompute it all.

``checkpoint(wrapped, x, use_reentrant=False)`` packs what the forward saves and, in the backward,
runs the function again, stopping it (``_StopRecomputationError``, raised from the pack hook) as
soon as the last tensor the forward saved is saved again: "early stop". In eager PyTorch every
side effect before that save has happened by then: BatchNorm's running statistics are updated a
second time, the module hooks run again. On the graph-break path the saves happen inside the
autograd Functions of TorchDynamo's graphs, and what TorchDynamo and AOTAutograd do after such a
Function returns (the buffer writes of its graph, the Python side effects Dynamo replays after
it: a forward hook appending to a list) never ran: the recompute updated BatchNorm's statistics
once where eager updates them twice (wave 53's review), silently. The whole-graph path has no such
gap: its one node saves its tensors after the captured graph has run, buffer writes included.

So while such a model runs inside a non-reentrant checkpoint, that checkpoint recomputes without
early stop (as ``checkpoint(..., early_stop=False)`` does): the recompute runs the function to its
end, with every side effect. Private: the checkpoint's frame is reached through the closure of
its saved-tensor hooks, the pair on top of autograd's stack; where they are not found (another
PyTorch), :func:`recompute_in_full` answers False.
"""

from __future__ import annotations

from typing import Any

import torch

# The pack hooks of torch/utils/checkpoint.py: the forward's (_checkpoint_hook, which holds the
# frame) and the recompute's (_recomputation_hook, a weak reference to it).
_FORWARD_PACK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_RECOMPUTE_PACK = "_recomputation_hook.__init__.<locals>.pack_hook"


def _closure(function: Any) -> dict[str, Any]:
    code = getattr(function, "__code__", None)
    cells = getattr(function, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells, strict=False)}


def _frame_of(pack: Any) -> Any:
    """The checkpoint frame a pack hook of torch/utils/checkpoint.py belongs to, or None."""
    name = getattr(pack, "__qualname__", "")
    if name == _FORWARD_PACK:
        return _closure(pack).get("frame")
    if name == _RECOMPUTE_PACK:
        reference = _closure(pack).get("target_frame_ref")
        return reference() if callable(reference) else None
    return None


def recompute_in_full() -> bool:
    """Where a non-reentrant checkpoint's hooks are on top, turn its early stop off. Whether the
    recompute (if any) runs to its end: True where no checkpoint packs (nothing, ``save_on_cpu``,
    the user's own hooks), False where a checkpoint's hooks are not the ones known here."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return True
    pack = hooks[0]
    pack = getattr(pack, "__wrapped__", pack)  # the recompute's is wrapped by torch._dynamo.disable
    if getattr(pack, "__module__", None) != "torch.utils.checkpoint":
        return True
    frame = _frame_of(pack)
    if frame is None or not hasattr(frame, "early_stop"):
        return False
    frame.early_stop = False
    return True
