"""A backward called inside ``torch.autocast``: said once, as its graph was traced outside it.

AOTAutograd traces the backward with the forward's autocast by default, which gave the gradient
of a float32 matmul in an ``autocast(enabled=False)`` region in bfloat16 where eager's, with the
backward called after the ``with torch.autocast`` block as PyTorch recommends (and as the Hugging
Face Trainer and accelerate do), is float32 (wave 44). ortrain traces the backward without
autocast (:mod:`ortrain.capture.aot_capture`). Eager autocasts the backward's ops when
``backward()`` itself runs inside the block, so those gradients then differ from eager's in the
low bits: a hook on the graph's backward node sees the autocast state the engine runs it with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ortrain.ortmodule.create_graph import hook_backward_node

logger = logging.getLogger("ortrain.ortmodule")

_warned = False


def _before_backward(grad_outputs: Any) -> None:
    global _warned
    if _warned or not torch._C._is_any_autocast_enabled():
        return
    _warned = True
    logger.warning(
        "backward() ran inside torch.autocast: ortrain's backward graph was traced outside "
        "autocast, as PyTorch recommends calling backward, so float32 work of the backward (the "
        "gradients of regions under autocast(enabled=False)) stays float32 where eager would "
        "autocast it. Call backward after the `with torch.autocast(...)` block for eager's numbers."
    )


def watch_for_backward_under_autocast(outputs: Sequence[Any]) -> None:
    """Hook the backward node of a forward that ran under autocast (nothing once warned)."""
    if not _warned:
        hook_backward_node(outputs, _before_backward)
