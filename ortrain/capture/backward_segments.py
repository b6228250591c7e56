"""Where to cut a backward graph into consecutive ONNX Runtime sessions, so that its inputs die early.

ONNX Runtime never frees a graph input during a run: every saved activation, and the tangent of
each output, lives until the whole backward run ends, where eager PyTorch frees each saved
tensor after the node that reads it last. Cut the backward graph in its own (topological) order
into a few segments, each one session, and an input read last in segment ``k`` is freed when
``k`` ends (the plan runner drops it; see :mod:`ortrain.runtime.partitioner`).

The cuts follow the bytes freed: the ``i``-th of ``count - 1`` cuts lands where the inputs read
for the last time so far reach ``i / count`` of the inputs' bytes, moved within that share to the
place where the fewest bytes of values made before it are read after it (each such value becomes
a segment output that lives until its segment ends). The loss backward of a language model, whose
(batch x seq) x vocab tensors are the largest of the run, ends up in a segment of its own.
"""

from __future__ import annotations

import operator

import torch

from ortrain.capture.memory_optimizer import tensor_bytes

# A cut costs a session run a step and its boundary's values; below this many input bytes freed
# per segment (at the captured sizes) it is not worth one.
MIN_BYTES_PER_SEGMENT = 1 << 20


def backward_segments(graph: torch.fx.Graph, count: int) -> list[list[torch.fx.Node]]:
    """The compute nodes of ``graph`` in order, cut into at most ``count`` non-empty segments (a
    ``getitem`` goes with the node it unpacks). One segment when there is nothing worth cutting."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    if count <= 1 or len(nodes) < 2 * count:
        return [nodes] if nodes else []
    position = {n: i for i, n in enumerate(nodes)}
    returned = set(graph.output_node().all_input_nodes)
    last = len(nodes) - 1
    # Bytes of graph inputs whose last reader is node i (freed when the segment holding i ends).
    freed = [0] * len(nodes)
    total = 0
    for placeholder in (n for n in graph.nodes if n.op == "placeholder"):
        readers = [position[u] for u in placeholder.users if u in position]
        if readers and placeholder not in returned:
            size = tensor_bytes(placeholder)
            freed[max(readers)] += size
            total += size
    count = min(count, total // MIN_BYTES_PER_SEGMENT)
    if count <= 1:
        return [nodes]
    # Bytes of computed values that a cut after node i would carry into a later segment (graph
    # outputs excepted: they live until the run ends either way).
    change = [0] * (len(nodes) + 1)
    for node in nodes:
        readers = [position[u] for u in node.users if u in position]
        if node in returned or not readers:
            continue
        size = tensor_bytes(node)
        change[position[node]] += size
        change[max(readers)] -= size
    crossing, carried = [], 0
    for delta in change[:-1]:
        carried += delta
        crossing.append(carried)
    cumulative = 0
    freed_so_far = []
    for size in freed:
        cumulative += size
        freed_so_far.append(cumulative)
    cuts: list[int] = []
    for share in range(1, count):
        low, high = total * (share - 0.5) / count, total * (share + 0.5) / count
        window = [i for i in range(last) if low <= freed_so_far[i] <= high and freed[i]]
        if not window:
            continue
        # Where inputs die, the cheapest place to cut; ties go to the earliest.
        best = min(window, key=lambda i: (crossing[i], i))
        if not cuts or best > cuts[-1]:
            cuts.append(best)
    segments: list[list[torch.fx.Node]] = []
    start = 0
    for cut in [*cuts, last]:
        segments.append(nodes[start : cut + 1])
        start = cut + 1
    return _with_unpacked_values([s for s in segments if s])


def _with_unpacked_values(segments: list[list[torch.fx.Node]]) -> list[list[torch.fx.Node]]:
    """Move each ``getitem`` into the segment of the node it unpacks (a region returns values, not
    tuples)."""
    owner: dict[torch.fx.Node, int] = {}
    moved: list[list[torch.fx.Node]] = [[] for _ in segments]
    for index, segment in enumerate(segments):
        for node in segment:
            source = node.args[0] if node.target is operator.getitem and node.args else None
            home = owner.get(source, index) if isinstance(source, torch.fx.Node) else index
            owner[node] = home
            moved[home].append(node)
    return [s for s in moved if s]
