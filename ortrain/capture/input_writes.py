"""The graph inputs a functional forward writes: AOTAutograd returns their new values as outputs
and copies them into the inputs after the forward runs."""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput


def written_back(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, Any]]:
    """``(placeholder, new value)`` for each input whose new value the graph returns to be copied
    back (AOTAutograd's ``InputMutationAOTOutput`` outputs), in output order."""
    placeholders = {n.meta["desc"]: n for n in graph.find_nodes(op="placeholder") if "desc" in n.meta}
    output = graph.output_node()
    descs = output.meta.get("desc") or ()
    return [
        (placeholders[desc.mutated_input], value)
        for desc, value in zip(descs, output.args[0], strict=False)  # type: ignore[arg-type]
        if isinstance(desc, InputMutationAOTOutput) and desc.mutated_input in placeholders
    ]
