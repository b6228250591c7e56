"""The forward's outputs that the forward also uses itself (``return head(h), h``).

Such an output's gradient has two parts: what the loss gives it from outside the model, and what
flows back into it from its uses inside. Eager PyTorch adds both before a gradient hook on it
runs; the captured graph is one autograd node, which hands the hook the outside part only, and
computes the inside part within its backward (as under ``torch.compile``). A hook that only reads
sees part of the gradient; one that changes it (gradient reversal, ``h.register_hook(lambda g:
-g)``) leaves the layers below with the wrong gradient (wave 46's review: 4.91 where eager's
norm was 2.15, silently). ``ortrain.ortmodule.output_hooks`` refuses such hooks at the backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch._aot_autograd.schemas import OutputType


def outputs_used_inside(graph: torch.fx.Graph, metadata: Any) -> frozenset[int]:
    """The positions, among the user's outputs, of those that require grad and that other nodes of
    the forward ``graph`` read (``metadata``: AOTAutograd's view of the forward)."""
    if metadata is None:
        return frozenset()
    output = graph.output_node()
    values = output.args[0]
    first = metadata.num_mutated_inp_runtime_indices  # the new values of mutated inputs come first
    used = set()
    for i, info in enumerate(metadata.output_info):
        if not info.requires_grad or info.output_type != OutputType.non_alias or first + i >= len(values):
            continue
        node = values[first + i]
        if isinstance(node, torch.fx.Node) and any(user is not output for user in node.users):
            used.add(i)
    return frozenset(used)
