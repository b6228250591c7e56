"""Each graph-break ORTModule's TorchDynamo code kept apart, and dropped with the ORTModule.

TorchDynamo keeps the code it compiles on the Python code object it compiled (the model class's
``forward``, the functions resumed after each graph break), for every caller alike, and falls
back to eager PyTorch for that code object after eight entries. Each ORTModule on the graph-break
path compiles with a backend of its own, which no other entry's guards accept: so the ninth
ORTModule of one model class in a process (a hyper-parameter search, cross-validation folds, a
test suite) ran in eager PyTorch, silently but for one warning of TorchDynamo's (wave 37). With
``torch.compile(isolate_recompiles=True)`` each ORTModule's entries count against its own limit.

Entries are not dropped when their model is: nothing in them is held weakly, so each dead
ORTModule's graphs, sessions and guards stayed on the code object (1.6 MiB a tiny MLP). A
bytecode hook records which code objects each region compiled; when the ORTModule's path is
collected, those entries are invalidated, as TorchDynamo itself invalidates an entry whose
guarded object died.
"""

from __future__ import annotations

import logging
import threading
import types
from typing import Any

from torch._C._dynamo.eval_frame import get_eval_frame_isolate_recompiles_id
from torch._dynamo.convert_frame import register_bytecode_hook
from torch._dynamo.eval_frame import _get_cache_entries_for_region
from torch._dynamo.guards import DeletedGuardManagerWrapper

logger = logging.getLogger("ortrain.capture")

_LOCK = threading.Lock()
_CODES: dict[int, set[types.CodeType]] = {}  # region id -> code objects compiled in it
_HOOK: list[Any] = []


def _record(code: types.CodeType, new_code: types.CodeType) -> None:
    codes = _CODES.get(get_eval_frame_isolate_recompiles_id())
    if codes is not None:
        codes.add(code)


def open_region(compiled: Any) -> int:
    """The region of ``compiled`` (a ``torch.compile(..., isolate_recompiles=True)`` result),
    whose code objects are recorded from now on."""
    region: int = compiled.dynamo_ctx._isolate_recompiles_id
    with _LOCK:
        if not _HOOK:
            _HOOK.append(register_bytecode_hook(_record))
        _CODES[region] = set()
    return region


def close_region(region: int) -> int:
    """Invalidate the region's entries; returns how many."""
    with _LOCK:
        codes = _CODES.pop(region, set())
    dropped = 0
    for code in codes:
        for entry in _get_cache_entries_for_region(code, region):
            guards = entry.guard_manager
            extra_state = getattr(guards, "extra_state", None)
            if extra_state is None or isinstance(guards, DeletedGuardManagerWrapper):
                continue
            extra_state.invalidate(entry, DeletedGuardManagerWrapper("its ORTModule was collected"))
            dropped += 1
    logger.debug("dropped %d TorchDynamo entries of a collected ORTModule", dropped)
    return dropped
