"""Regions run so that random operators draw in the captured graph's order.

PyTorch's generator is one stream: each draw starts where the previous one ended, so a dropout
mask depends on every draw before it. Eager PyTorch draws in program order, which is the
captured graph's order. The partitioner merges independent chains into one region where it can
(T5's last encoder dropout and its decoder's first, which do not depend on each other), and orders
regions by their data dependencies only: such a region drew the decoder's mask before the
encoder's remaining ones, so the masks were other than eager's and than the all-PyTorch
placement's. Op tuning switches a graph between placements in its first calls, so a checkpointed
layer could recompute its forward with other masks than the forward's (a wrong gradient), and
two runs of one script under one seed could train differently.

The rule that keeps the draws in order: number the "epochs" of the graph's order, a new one
starting at each drawing node (a random operator, or an opaque autograd Function, whose Python
may draw); cut every region where an epoch ends, then run the regions epoch by epoch.

- The cut makes no cycle: a region is split at positions of a topological order, so no part can
  depend on a later part of itself, and a cycle through other regions would have been one before.
- Ordering by epoch respects the data: a value flows from a node to a later one, never to an
  earlier epoch.
- Each epoch holds one drawing node, so draws happen in the graph's order.

Graphs with fewer than two drawing nodes have nothing to order and are left as partitioned.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping

import torch

from ortrain.capture.python_ops import PYTHON_OPS
from ortrain.runtime.torch_native_ops import is_random


def draws(node: torch.fx.Node) -> bool:
    """Whether running ``node`` may take numbers from PyTorch's generator."""
    return node.op == "call_function" and (node.target in PYTHON_OPS or is_random(node))


def draw_epochs(graph: torch.fx.Graph) -> dict[str, int] | None:
    """Node name -> its epoch (how many drawing nodes come at or before it in the graph's order);
    None when the graph has fewer than two drawing nodes."""
    epochs: dict[str, int] = {}
    epoch = 0
    for node in graph.nodes:
        if draws(node):
            epoch += 1
        epochs[node.name] = epoch
    return epochs if epoch >= 2 else None


def split_by_epoch(
    groups: Iterable[set[torch.fx.Node]], epochs: Mapping[str, int]
) -> list[tuple[int, set[torch.fx.Node]]]:
    """Each group cut into its parts of one epoch each, as ``(epoch, part)``."""
    parts: list[tuple[int, set[torch.fx.Node]]] = []
    for group in groups:
        by_epoch: dict[int, set[torch.fx.Node]] = {}
        for node in group:
            by_epoch.setdefault(_epoch_of(node, epochs), set()).add(node)
        parts.extend(sorted(by_epoch.items(), key=operator.itemgetter(0)))
    return parts


def _epoch_of(node: torch.fx.Node, epochs: Mapping[str, int]) -> int:
    # A getitem stays with what it unpacks, which the fuser needs in the same region.
    if node.target is operator.getitem and isinstance(source := node.args[0], torch.fx.Node):
        return epochs.get(source.name, epochs[node.name])
    return epochs[node.name]


def order_by_epoch(graph: torch.fx.Graph, region_epochs: Mapping[str, int]) -> None:
    """Move the fused regions (``call_module`` nodes named in ``region_epochs``) and their
    ``getitem`` unpackings into epoch order, keeping the current order within an epoch."""
    first: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            first[node] = region_epochs[str(node.target)]
        elif node.target is operator.getitem and node.args and node.args[0] in first:
            first[node] = first[node.args[0]]  # type: ignore[index]
    nodes = list(first)
    ranked = sorted(nodes, key=lambda n: first[n])  # stable: within an epoch, as fused
    if ranked == nodes:
        return
    output = graph.output_node()
    for node in ranked:
        output.prepend(node)
