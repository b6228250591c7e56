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

So does an output of its own (not a view of anything) that the trace, like eager PyTorch, laid
out permuted (``linear(x).transpose(0, 1)`` before a graph break): the Python between TorchDynamo's
graphs, and the next graph, traced on the tensor it is given, read its layout. A dropout there
draws its mask in memory order, so ONNX Runtime's contiguous copy drew other masks than eager
under the same seed (wave 38: WavLM with layer drop, whose layers then ran in graphs of their
own, trained 2e-3 apart from eager from its second step, in float64 too). The same holds for a
whole-graph capture's outputs, which the caller's code reads (a dropout on a wrapped encoder's
output), as ``torch.compile`` keeps its outputs' eager strides.

An output remade from an input that is not dense at all (``self.bias.expand(batch, n)``: a zero
stride) cannot be described by a dimension order: AOTAutograd remade it with ONNX Runtime's
contiguous strides, out of the parameter's bounds, and the step failed from the second (dynamic)
capture on. Where the trace's strides and storage offset are plain numbers, the compiled graph
hands over an empty tensor laid out with them (:class:`RemadeStrides`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch._functorch._aot_autograd.schemas import OutputType

from ortrain.capture.memory_layouts import (
    dense_dim_order,
    densely_in_order,
    permuted_dim_order,
    size_hint,
)

# Outputs the user gets as the graph returned them: aliasing nothing, or (``unsafe_view_alias``)
# a view of an intermediate the graph does not return, which AOTAutograd then treats as its own.
_OWN = (OutputType.non_alias, OutputType.unsafe_view_alias)


class RemadeStrides(NamedTuple):
    """The trace's strides and storage offset of an output AOTAutograd remakes from an input,
    where no dimension order describes them (plain data: saved with a cache entry)."""

    strides: tuple[int, ...]
    offset: int


# Output position -> the dimension order to hand it over in, or the strides to describe it with.
Layouts = dict[int, tuple[int, ...] | RemadeStrides]


def _concrete(values: tuple[Any, ...]) -> tuple[int, ...] | None:
    """``values`` as ints when none of them is symbolic, else None."""
    if not all(isinstance(v, int) or (isinstance(v, torch.SymInt) and v.node.is_constant()) for v in values):
        return None
    return tuple(int(v) for v in values)


def traced_layouts(graph: torch.fx.Graph, metadata: Any = None) -> Layouts:
    """Output position -> dimension order, for the user-visible outputs of an AOTAutograd forward
    traced in a permuted dense layout at storage offset 0 (those remade from an input, and those
    that alias nothing). ``metadata``: AOTAutograd's view of the forward (by default the tracing
    context's, which TorchDynamo's compiles set)."""
    if metadata is None:
        context = torch._guards.TracingContext.try_get()
        metadata = getattr(context, "fw_metadata", None)
    if metadata is None:
        return {}
    first = metadata.num_mutated_inp_runtime_indices  # the new values of mutated inputs come first
    output = graph.output_node()
    results = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    layouts: Layouts = {}
    for index, info in enumerate(metadata.output_info):
        # Outputs remade from an input (the tensor returned gives its layout and is then dropped)
        # and outputs of their own, a base of other outputs' views included: AOTAutograd remakes
        # the views from it, and from ONNX Runtime's contiguous copy ``h.permute(0, 2, 3,
        # 1).reshape(-1, C)`` of a channels_last ``h`` failed ("view size is not compatible"),
        # and a dropout on the base drew other masks than eager's (wave 45's review).
        remade = info.output_type == OutputType.alias_of_input
        own = info.output_type in _OWN
        if not (remade or own) or first + index >= len(results):
            continue
        position = first + index
        node = results[position]
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        if remade and dense_dim_order(value) is None:
            strides, offset = _concrete(tuple(value.stride())), _concrete((value.storage_offset(),))
            if strides is not None and offset is not None:
                layouts[position] = RemadeStrides(strides, offset[0])
            continue
        if size_hint(value.storage_offset()) != 0:
            continue
        order = permuted_dim_order(value)
        if order is not None:
            layouts[position] = order
    return layouts


def _laid_out_as(tensor: torch.Tensor, layout: RemadeStrides) -> torch.Tensor:
    """An uninitialised tensor of ``tensor``'s size laid out as ``layout`` says: AOTAutograd reads
    only its layout, to remake the output from the input (not a view: its base would be read)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, layout.strides, strict=True))
    memory = torch.empty(layout.offset + max(span, 0), dtype=tensor.dtype, device=tensor.device)
    laid_out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return laid_out.set_(memory.untyped_storage(), layout.offset, tensor.shape, layout.strides)


def in_traced_layouts(layouts: Layouts, outputs: list[Any]) -> None:
    for position, layout in layouts.items():
        if not isinstance(outputs[position], torch.Tensor):
            continue
        if isinstance(layout, RemadeStrides):
            outputs[position] = _laid_out_as(outputs[position], layout)
        else:
            # A tensor of its own, not a view of a permuted copy: Dynamo took a view of such a
            # view, the next graph's input, for a view and failed to fake it.
            outputs[position] = densely_in_order(outputs[position], layout)
