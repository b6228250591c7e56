"""Random operators in PyTorch see their inputs in the memory layout the capture recorded.

PyTorch draws a random tensor "like" its input (dropout's mask, ``rand_like``, ``bernoulli``) in
the input's memory order: ``empty_like`` keeps a transposed input's strides and the generator
fills memory front to back, so the same seed gives other masks for a transposed input than for a
contiguous one with the same values. Eager PyTorch's dropout after a ``transpose`` (the output of
``nn.MultiheadAttention`` with ``batch_first=True``) draws in the transposed order; a value that
reaches PyTorch from ONNX Runtime is contiguous. So a region run by PyTorch after ONNX Runtime drew
other masks than eager and than the all-PyTorch placement: under ``torch.utils.checkpoint``, with
op tuning switching placements between the forward and its recompute, the recompute's masks were
not the forward's (a wrong gradient).

The same holds for ``as_strided`` of a tensor traced in a permuted layout, which PyTorch runs
(it reads memory by strides: ``torch_native_ops``): given ONNX Runtime's contiguous copy it
would pick other elements.

Before such an operator, its tensor inputs are put back in the dimension order the capture
recorded for them (a copy only when the run-time layout differs), which makes the draws eager's
and the same in every placement. Recorded layouts that are not dense (a broadcast input, a slice
with gaps) are left as they come: their draws may differ from eager's, as before.

Determinants too (``torch_native_ops.factors_by_layout``), in both directions: PyTorch factors a
contiguous matrix's transpose, and the backward AOTAutograd traced solves with the factors as the
traced layout made them. A column-major matrix (a transpose, ``torch.linalg.qr``'s Q) that reached
``slogdet`` contiguous from ONNX Runtime got the transposed gradient (wave 48's review: Glow's
invertible 1x1 convolution, 42 off where the largest gradient was 6.4; the loss exact).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ortrain.capture.lazy_recompile import graph_module
from ortrain.capture.memory_layouts import dense_dim_order, densely_in_order, permuted_dim_order
from ortrain.runtime.torch_native_ops import factors_by_layout, reads_memory_layout

logger = logging.getLogger("ortrain.runtime")


def in_dim_order(tensor: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``tensor`` with the same values, laid out densely in ``order`` (itself when it already is):
    the name the regions' code calls."""
    return densely_in_order(tensor, order)


def _recorded_order(node: torch.fx.Node, arg: torch.fx.Node) -> tuple[int, ...] | None:
    """The dimension order ``arg`` must have when ``node`` runs (None: any)."""
    if reads_memory_layout(node):
        return permuted_dim_order(arg.meta.get("val"))
    if factors_by_layout(node):
        value = arg.meta.get("val")
        order = dense_dim_order(value)  # the plain order as well: contiguous again
        if order is None and _known_not_contiguous(value):
            # A slice with gaps, a broadcast (review of wave 48's diff: ``det(W[:, :4])``): any
            # layout that is not contiguous gives the factors the traced backward reads.
            dims = value.dim()
            order = (*range(dims - 2), dims - 1, dims - 2)
        return order
    return None


def _known_not_contiguous(value: object) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    try:
        return not bool(value.is_contiguous())
    except Exception:  # a layout whose contiguity depends on open sizes: left as it comes
        return False


def with_random_op_layouts(region: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``region``, or a copy of it (the plan keeps describing the partition) where
    :func:`in_dim_order` comes before each random operator's tensor inputs whose recorded layout is
    not contiguous."""
    restores = [
        (node, arg, order)
        for node in region.graph.nodes
        if node.op == "call_function"
        for arg in dict.fromkeys(a for a in node.args if isinstance(a, torch.fx.Node))
        if (order := _recorded_order(node, arg)) is not None
    ]
    if not restores:
        return region
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(region.graph, copies))
    for node, arg, order in restores:
        with graph.inserting_before(copies[node]):
            laid_out = graph.call_function(in_dim_order, (copies[arg], order))
        laid_out.meta["val"] = arg.meta.get("val")
        copies[node].replace_input_with(copies[arg], laid_out)
    logger.debug("random operators: %d input(s) restored to their recorded layout", len(restores))
    return graph_module(region, graph)
