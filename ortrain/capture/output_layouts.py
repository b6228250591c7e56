"""The forward's outputs in the memory layout of the trace, where AOTAutograd makes views of them.

A graph output that is a view of a graph input the graph also writes into (Longformer's attention
scores: ``scores[...] = ...`` into a tensor made before a graph break, then returned through
``.view().transpose()``) is remade by AOTAutograd after every call from that input, with the
size, strides and storage offset of what the compiled graph returned, whenever its views have
symbolic sizes (no replay of the view functions then). ONNX Runtime returns contiguous tensors:
the remade view read the input in the wrong order, and wave 23's Longformer trained on scores
with the masks in the wrong places, without a word, from its second sequence length on.

So an output AOTAutograd remakes from an input leaves the compiled graph laid out as its trace
was: a permuted dense layout is copied into that order (the tensor itself is then dropped: only
its strides are read).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch._aot_autograd.schemas import OutputType

from ortrain.capture.memory_layouts import densely_in_order, permuted_dim_order, size_hint


def traced_layouts(graph: torch.fx.Graph) -> dict[int, tuple[int, ...]]:
    """Output position -> dimension order, for the user-visible outputs of an AOTAutograd forward
    traced in a permuted dense layout at storage offset 0."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    if metadata is None:
        return {}
    first = metadata.num_mutated_inp_runtime_indices  # the new values of mutated inputs come first
    output = graph.output_node()
    results = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    layouts: dict[int, tuple[int, ...]] = {}
    for index, info in enumerate(metadata.output_info):
        # Only outputs remade from an input: the tensor returned gives its layout and is then
        # dropped. (A base of views is handed to the user: left as ONNX Runtime made it.)
        if info.output_type != OutputType.alias_of_input or first + index >= len(results):
            continue
        position = first + index
        node = results[position]
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or size_hint(value.storage_offset()) != 0:
            continue
        order = permuted_dim_order(value)
        if order is not None:
            layouts[position] = order
    return layouts


def in_traced_layouts(layouts: dict[int, tuple[int, ...]], outputs: list[Any]) -> None:
    for position, order in layouts.items():
        if isinstance(outputs[position], torch.Tensor):
            # A tensor of its own, not a view of a permuted copy: Dynamo took a view of such a
            # view, the next graph's input, for a view and failed to fake it.
            outputs[position] = densely_in_order(outputs[position], order)
