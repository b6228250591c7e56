"""``repeat_interleave``'s ``output_size`` is a hint: dropped before translation.

``torch.repeat_interleave(g, counts, dim=0, output_size=n)`` (broadcasting graph-level features
back to their nodes, in the form ``torch.compile`` recommends) reaches the export with the hint,
which onnxscript's translation refuses as an unexpected keyword: the region around it ran in
PyTorch (wave 47's review: 12 operators at open sizes, and refused under ``FALLBACK_DISABLE``).
The output's size is the sum of the counts either way.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def drop_output_size_hints(gm: torch.fx.GraphModule) -> int:
    """Drop ``output_size`` from each ``repeat_interleave`` node of ``gm``; returns how many."""
    dropped = 0
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
        if packet is aten.repeat_interleave and "output_size" in node.kwargs:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "output_size"}
            dropped += 1
    if dropped:
        gm.recompile()
    return dropped
