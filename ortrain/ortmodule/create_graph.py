"""``backward(create_graph=True)`` through a graph that cannot be differentiated again: say so at once.

Training calls take the twice-differentiable path of :mod:`ortrain.ortmodule.second_order`. The
calls it cannot recompute faithfully keep AOTAutograd's node, whose gradients have no graph of
their own: a model that writes into its input in place (the recompute would read the written
values), one whose graph reads a tensor that requires grad and is neither its parameter nor an
input of the call (the recompute would not reach it), and one whose graphs call Python objects (a
reentrant checkpoint refuses the autograd.grad the recomputing node runs). AOTAutograd refuses to
differentiate those gradients again ("torch.compile with aot_autograd does not currently support
double backward"), which is right, but its message names torch.compile and comes only at the
second backward; the user learns here, at the first one, what to do instead. The engine runs a
backward with gradients enabled only under ``create_graph=True``, which a hook on the graph's node
sees before it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger("ortrain.ortmodule")

_warned = False


def _before_backward(grad_outputs: Any) -> None:
    global _warned
    if _warned or not torch.is_grad_enabled():
        return
    _warned = True
    logger.warning(
        "backward(create_graph=True) through an ORTModule graph that cannot be recomputed in "
        "PyTorch (the model writes into its input in place, reads a tensor that requires grad and "
        "is neither its parameter nor an input, calls opaque autograd Functions or reentrant "
        "checkpoints, or trains through TorchDynamo's graph breaks): its gradients come from the "
        "captured backward graph and cannot be differentiated again (a second backward raises "
        "'does not currently support double backward'). For a second-order term, run that "
        "forward on the plain model, `wrapped.module`."
    )


def watch_for_create_graph(outputs: Sequence[Any]) -> None:
    """Hook the captured graph's backward node (once the warning is out, nothing is hooked)."""
    if not _warned:
        hook_backward_node(outputs, _before_backward)


def hook_backward_node(outputs: Sequence[Any], hook: Any) -> None:
    """Register ``hook`` before the backward node of the first output that has one (the captured
    graph's: every output of one call shares it), which runs with the engine's state."""
    for output in outputs:
        node = getattr(output, "grad_fn", None)
        if node is not None:
            node.register_prehook(hook)
            return
