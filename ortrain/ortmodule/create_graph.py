"""``backward(create_graph=True)`` through a captured graph: say at once that its gradients are first-order.

AOTAutograd connects the gradients of a captured backward to the autograd graph but refuses to
differentiate them again ("torch.compile with aot_autograd does not currently support double
backward"): the saved activations it reads came out of a compiled forward and carry no history,
so a second-order term would be wrong, and raising is right. A call with an input that requires
grad (where a gradient penalty starts) takes the path of :mod:`ortrain.ortmodule.second_order`,
which can differentiate again; this module covers the others (a second-order term in the
parameters alone). AOTAutograd's message names torch.compile, though, and comes only at the
second backward; the user learns here, at the first one, what to do instead. The engine runs a
backward with gradients enabled only under ``create_graph=True``, which a hook on the graph's node
sees before the node runs.
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
        "backward(create_graph=True) through ORTModule with no input that requires grad: its "
        "gradients come from the captured backward graph and cannot be differentiated again (a "
        "second backward raises 'does not currently support double backward'). A gradient "
        "penalty with respect to an input works (give that input requires_grad=True); for a "
        "second-order term in the parameters alone, run that forward on the plain model, "
        "`wrapped.module`."
    )


def watch_for_create_graph(outputs: Sequence[Any]) -> None:
    """Hook the captured graph's backward node (once the warning is out, nothing is hooked)."""
    if _warned:
        return
    for output in outputs:
        node = getattr(output, "grad_fn", None)
        if node is not None:
            node.register_prehook(_before_backward)
            return
