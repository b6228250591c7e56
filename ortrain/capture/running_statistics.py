"""BatchNorm's running statistics written back as eager's kernel writes them: version counters kept.

Eager's ``native_batch_norm`` updates ``running_mean`` and ``running_var`` inside the kernel, and
their version counters stay where they were. A captured graph returns the new statistics instead,
and AOTAutograd copies them into the buffers after the forward (``copy_``), which moves the
counters. A backward that saved the buffers earlier in the step then refused to run ("is at
version 2; expected version 1", wave 54's review): eager's own BatchNorm backward where one
BatchNorm serves an eager path and a wrapped one, or a wrapped model's eval-mode call (whose graph
saved the statistics it normalized with) followed by a training-mode call before the backward.
Eager runs both (the eval-mode backward reads the statistics as they are by then, in eager and
here alike: the same buffer).

Around a captured call, the counters of exactly the inputs whose only writer in the graph is a
batch norm's statistics update are put back after the write-back. Any other in-place write (a
user's ``buf.add_(x)``, ``num_batches_tracked``'s ``add_(1)``) moves them, as in eager, and
autograd keeps refusing a backward that saved their old values.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ortrain.capture.input_writes import written_back

aten = torch.ops.aten

# A functional batch norm's output index of each new statistic -> the argument index of the old.
_UPDATES = {
    aten._native_batch_norm_legit_functional.default: {3: 3, 4: 4},
    aten._batch_norm_with_update_functional.default: {4: 3, 5: 4},
}


def _statistic_source(node: Any) -> torch.fx.Node | None:
    """The placeholder whose statistics ``node`` is the update of, through batch norms only (one
    BatchNorm called twice in a forward updates the first call's new values); None where anything
    else computed it."""
    while isinstance(node, torch.fx.Node):
        if node.op == "placeholder":
            return node
        if node.op != "call_function" or node.target is not operator.getitem:
            return None
        norm, index = node.args
        updates = _UPDATES.get(getattr(norm, "target", None))
        if updates is None or index not in updates:
            return None
        node = norm.args[updates[index]]
    return None


def batch_norm_statistics(forward: torch.fx.Graph) -> list[Any]:
    """The descriptors (AOTAutograd's ``AOTInput``) of the forward graph's inputs whose new value,
    written back after the forward, only batch norms' statistics updates computed."""
    return [
        placeholder.meta["desc"]
        for placeholder, value in written_back(forward)
        if _statistic_source(value) is placeholder
    ]


@contextlib.contextmanager
def versions_kept(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within the block the tensors may be written; afterwards their version counters read as
    before it (an inference tensor has none)."""
    kept = tuple(t for t in tensors if not t.is_inference())
    if not kept:
        yield
        return
    with torch.autograd._unsafe_preserve_version_counter(kept):
        yield
