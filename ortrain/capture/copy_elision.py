"""Drop forward ``clone``s that copy a tensor into the layout it already has.

Decompositions write ``clone`` where eager PyTorch would return a view: ``matmul`` of a 4-D by a
4-D tensor expands both and reshapes them to 3-D, which copies only where the layout demands it;
traced, it is ``expand`` + ``clone`` + ``_unsafe_view`` whatever the layout. When the copied
tensor is also saved for backward (attention probabilities: softmax's backward reads them, so does
``probs @ v``'s), the partitioner then stashes the tensor *and* its copy, where eager saves one
storage (spelled-out attention of the tiny GPT: one batch x heads x seq x seq tensor a layer
stashed twice). In a functional graph a clone with its input's strides holds the same values, so
its users can read the input instead.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ortrain.capture.view_ops import RELAYOUTS

aten = torch.ops.aten


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    pairs = [*zip(a.shape, b.shape, strict=True), *zip(a.stride(), b.stride(), strict=True)]
    return all(statically_known_true(x == y) for x, y in pairs)


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a chain of views starts from."""
    while node.op == "call_function" and node.target in RELAYOUTS and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _reaches_output(node: torch.fx.Node) -> bool:
    """Whether the graph returns ``node`` or a view of it."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user.op == "output":
                return True
            if user.target in RELAYOUTS and user.args and user.args[0] is current:
                todo.append(user)
    return False


def drop_layout_preserving_clones(graph: torch.fx.Graph) -> int:
    """Make forward readers of a layout-preserving ``clone`` read its input; returns how many."""
    dropped = 0
    for node in list(graph.nodes):
        if node.target is not aten.clone.default or node.meta.get("partitioner_tag") != "is_forward":
            continue
        (source,) = node.args[:1]
        if not isinstance(source, torch.fx.Node) or _base(source).op != "call_function":
            continue  # a copy of (a view of) an input or parameter: nothing may alias those
        if _reaches_output(node):
            continue  # a returned tensor must stay its own, whatever it was copied from
        if any(getattr(u.target, "_schema", None) is None for u in node.users):
            continue
        if any(u.target._schema.is_mutable for u in node.users):  # type: ignore[union-attr]
            continue
        before, after = source.meta.get("val"), node.meta.get("val")
        if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
            continue
        if not _same_layout(before, after):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        dropped += 1
    return dropped
