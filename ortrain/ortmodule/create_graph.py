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

# Why a call has no twice-differentiable node, as the warning names it (until wave 53 the warning
# listed every reason, the input written in place first, and a model on the graph-break path, say
# after a backward hook registered once and removed, read as a model writing into its input).
WRITES_ITS_INPUT = "the model writes into its input in place"
READS_AN_OUTSIDE_TENSOR = (
    "its graph reads a tensor that requires grad and is neither its parameter nor an input"
)
CALLS_PYTHON = "its graph calls opaque autograd Functions or reentrant checkpoints"
GRAPH_BREAKS = (
    "the model trains through TorchDynamo's graph breaks, as it has since the first call that "
    "needed them: data-dependent Python, or a module hook, even one removed since"
)


def _before_backward(why: str) -> Any:
    def hook(grad_outputs: Any) -> None:
        global _warned
        if _warned or not torch.is_grad_enabled():
            return
        _warned = True
        logger.warning(
            "backward(create_graph=True) through an ORTModule graph that cannot be recomputed in "
            "PyTorch (%s): its gradients come from the captured backward graph and cannot be "
            "differentiated again (a second backward raises 'does not currently support double "
            "backward'). For a second-order term, run that forward on the plain model, "
            "`wrapped.module`.",
            why,
        )

    return hook


def watch_for_create_graph(outputs: Sequence[Any], why: str) -> None:
    """Hook the captured graph's backward node (once the warning is out, nothing is hooked);
    ``why``: the reason the call has no twice-differentiable node, one of the texts above."""
    if not _warned:
        hook_backward_node(outputs, _before_backward(why))


def hook_backward_node(outputs: Sequence[Any], hook: Any) -> None:
    """Register ``hook`` before the backward node of the first output that has one (the captured
    graph's: every output of one call shares it), which runs with the engine's state."""
    for output in outputs:
        node = getattr(output, "grad_fn", None)
        if node is not None:
            node.register_prehook(hook)
            return
