"""Compute optimizer (``ORTMODULE_ENABLE_COMPUTE_OPTIMIZER``): select rows before token-wise work, not after.

A gather or slice of rows (``hidden[:, 0]`` before a classifier, the counted rows before a loss)
that follows token-wise layers (linear, layer norm, activations, residual adds, dropout) is moved
up past them, so the rows nobody reads are never computed: the classifier's last MLP runs on one
token, an LM head on the counted rows. A layer whose output something else also reads stays dense.

It runs on the pre-dispatch forward graph (see :mod:`ortrain.capture.forward_rewrite`);
AOTAutograd then derives the backward of the rewritten forward, which shrinks with it.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from ortrain.passes.rowwise import op_name, push_selection_up, selections

logger = logging.getLogger("ortrain.passes")


def _describe(node: torch.fx.Node) -> str:
    return (
        f"{node.target}".replace("aten.", "")
        .replace(".default", "")
        .replace(".Tensor", "")
        .replace(".int", "")
    )


def upstream_selections(gm: torch.fx.GraphModule) -> list[str]:
    """Move every row selection up as far as it goes; one line per selection moved."""
    changes = []
    for node in list(reversed(selections(gm.graph))):
        if getattr(node, "_erased", False):
            continue
        what = op_name(node)
        moved = push_selection_up(gm.graph, node)
        if moved:
            counts = ", ".join(f"{n} {name}" for name, n in Counter(moved).most_common())
            changes.append(
                f"compute optimizer: moved a {what} up past {len(moved)} token-wise ops ({counts})"
            )
            logger.info("%s", changes[-1])
    return changes
