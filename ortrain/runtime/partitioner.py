"""Give every node of a captured FX graph to the first executor that claims it, as regions.

Executors are asked in priority order (python op, ONNX Runtime, torch). Each executor's claimed
nodes are merged into the largest acyclic regions by torch.fx's ``CapabilityBasedPartitioner``
and fused into one ``call_module`` node per region before the next executor partitions what is
left, so the regions of a later executor see the earlier ones as single nodes and no two
regions can depend on each other both ways. Work that depends on the graph inputs alone (a
weight's transpose) joins the region of its reader, so it never crosses a region boundary as a
copy. A region of layout-only nodes (views, transposes) is not worth a boundary: those nodes go
to the next executor. A graph that one executor claims whole stays one region: the original
graph, with no copying or fusing (the one-session fast path).

Values that cross regions live in numbered slots: the graph's inputs are slots ``0..n-1``; every
other slot is written by one step. A slot is dropped after its last reader so that activations
are freed as early as in one graph.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.node import map_aggregate
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from ortrain.capture.backward_segments import backward_segments
from ortrain.capture.lazy_recompile import graph_module
from ortrain.capture.view_ops import RELAYOUTS
from ortrain.runtime.draw_order import draw_epochs, order_by_epoch, split_by_epoch
from ortrain.runtime.executors.base import Executor

_LAYOUT_ONLY = RELAYOUTS | {operator.getitem}


@dataclass(frozen=True)
class Slot:
    """A reference to a value slot inside the graph outputs."""

    index: int


@dataclass
class Step:
    executor: Executor
    name: str  # the region's name: "onnxruntime_0", "torch_1", "python_op_0", or "whole"
    region: torch.fx.GraphModule  # placeholders: its inputs; output: the tuple of its outputs
    inputs: list[int]  # the slot feeding each placeholder, in order
    outputs: list[int]  # the slot receiving each output, in order

    @property
    def nodes(self) -> list[torch.fx.Node]:
        return [n for n in self.region.graph.nodes if n.op not in ("placeholder", "output")]


@dataclass
class Plan:
    num_inputs: int
    num_slots: int
    steps: list[Step]
    outputs: Any  # the graph's output structure, with Slot where a value is returned
    placeholders: list[torch.fx.Node]  # of the original graph: slot i is placeholder i
    whole: bool  # one step runs the original graph
    values: dict[int, Any] = field(default_factory=dict)  # slot -> fake value (node.meta["val"])
    constants: dict[int, Any] = field(default_factory=dict)  # slot -> the graph's constant tensor
    frees: list[list[int]] = field(default_factory=list)  # per step: slots last read there

    def nodes_by_executor(self) -> dict[str, int]:
        """How many compute nodes (not getitems) each executor runs."""
        counts: dict[str, int] = {}
        for step in self.steps:
            computed = sum(n.op == "call_function" and n.target is not operator.getitem for n in step.nodes)
            counts[step.executor.name] = counts.get(step.executor.name, 0) + computed
        return counts


class _Claimed(OperatorSupportBase):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        return node.name in self.names


def claim(gm: torch.fx.GraphModule, executors: Sequence[Executor]) -> dict[str, int]:
    """Node name -> index of the first executor claiming it; a getitem goes with what it unpacks."""
    owners: dict[str, int] = {}
    for node in gm.graph.nodes:
        # Constants (get_attr) belong to no executor: a region reads them like graph inputs.
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, torch.fx.Node) and source.name in owners:
            owners[node.name] = owners[source.name]
            continue
        owner = next((i for i, e in enumerate(executors) if e.claims(node)), None)
        if owner is None:
            raise ValueError(f"no executor claims node {node.name} ({node.target})")
        owners[node.name] = owner
    return owners


def partition(gm: torch.fx.GraphModule, executors: Sequence[Executor], *, segments: int = 1) -> Plan:
    """``segments``: a graph one executor claims whole runs as up to that many consecutive regions,
    cut where its inputs die (:mod:`ortrain.capture.backward_segments`), so that the plan frees
    each input after the region that reads it last instead of after the whole graph."""
    owners = claim(gm, executors)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    claimants = set(owners.values())
    if len(claimants) <= 1:
        index = claimants.pop() if claimants else next(i for i, e in enumerate(executors) if e.merges)
        if executors[index].merges:
            if segments > 1:
                segmented = _segmented(gm, executors[index], placeholders, segments)
                if segmented is not None:
                    return segmented
            return _whole(gm, executors[index], placeholders)
    work = graph_module(gm, _copy(gm.graph))
    regions: dict[str, Executor] = {}
    # Random operators must draw in the graph's order (see ortrain.runtime.draw_order).
    epochs = draw_epochs(gm.graph)
    region_epochs: dict[str, int] = {}
    for index, executor in enumerate(executors):
        mine = {n for n in work.graph.nodes if owners.get(n.name) == index}
        if not mine:
            continue
        key = executor.name.replace(" ", "_")
        if executor.merges:
            partitioner = CapabilityBasedPartitioner(
                work, _Claimed({n.name for n in mine}), allows_single_node_partition=True
            )
            groups = _hoist_sinks([set(p.nodes) for p in partitioner.propose_partitions()], work.graph)
            if index != len(executors) - 1:
                dropped = [g for g in groups if all(n.target in _LAYOUT_ONLY for n in g)]
                groups = [g for g in groups if g not in dropped]
                for node in (n for g in dropped for n in g):
                    # The next executor that claims it takes it.
                    owners[node.name] = next(
                        i for i in range(index + 1, len(executors)) if executors[i].claims(node)
                    )
        else:
            groups = [
                {node, *(u for u in node.users if u.target is operator.getitem)}
                for node in mine
                if node.target is not operator.getitem
            ]
        if not groups:
            continue
        if epochs is not None:
            parts = split_by_epoch(groups, epochs)
            groups = [part for _, part in parts]
            region_epochs.update({f"{key}_{i}": epoch for i, (epoch, _) in enumerate(parts)})
        fuse_by_partitions(
            work, [dict.fromkeys(g) for g in groups], prefix=f"{key}_", always_return_tuple=True
        )
        regions.update({f"{key}_{i}": executor for i in range(len(groups))})
    if epochs is not None:
        order_by_epoch(work.graph, region_epochs)
        work.recompile()
    return _plan(work, regions, placeholders, gm.graph.nodes)


# Values every region can read (graph inputs and constants): they tie a node to no region.
_FREE_INPUTS = ("placeholder", "get_attr")


def _hoist_sinks(groups: list[set[torch.fx.Node]], graph: torch.fx.Graph) -> list[set[torch.fx.Node]]:
    """Nodes that only feed the graph's outputs, moved into the region that makes their inputs.

    The fuser grows the largest acyclic regions, and a node that feeds nothing later (a weight
    gradient's product, the transposes and sums before it) fits in any region after its inputs: it
    tended to land in the last one. Its inputs (a layer's output gradient, activation-sized) then
    stayed alive to the end of the backward run. Tiny GPT, batch 32, sequence 512: every layer left
    about 93 MiB more alive, 1279 -> 1557 MiB of live values over the backward instead of falling.

    A node moves to group G when each input is a graph input, in G or moving to G, and each user is
    the output or moves to G too: G then gains no edge to another region, so no cycle can form.
    """
    if len(groups) < 2:
        return groups
    owner = {n: i for i, group in enumerate(groups) for n in group}
    target: dict[torch.fx.Node, int] = {}
    for node in (n for n in graph.nodes if n in owner):  # inputs before users
        sources = {target.get(a, owner.get(a, -1)) for a in node.all_input_nodes if a.op not in _FREE_INPUTS}
        if len(sources) == 1 and (source := sources.pop()) not in (-1, owner[node]):
            target[node] = source
    changed = True
    while changed:  # drop moves whose users or inputs stay behind, until none does
        changed = False
        for node, group in list(target.items()):
            users_follow = all(u.op == "output" or target.get(u) == group for u in node.users)
            inputs_there = all(
                a.op in _FREE_INPUTS or target.get(a, owner.get(a)) == group for a in node.all_input_nodes
            )
            if not (users_follow and inputs_there):
                del target[node]
                changed = True
    for node, group in target.items():
        groups[owner[node]].discard(node)
        groups[group].add(node)
    return [group for group in groups if group]


def _segmented(
    gm: torch.fx.GraphModule, executor: Executor, placeholders: list[torch.fx.Node], count: int
) -> Plan | None:
    """The graph as consecutive regions of one executor; None when it is not worth cutting."""
    work = graph_module(gm, _copy(gm.graph))
    groups = backward_segments(work.graph, count)
    if len(groups) <= 1:
        return None
    key = executor.name.replace(" ", "_")
    fuse_by_partitions(work, [dict.fromkeys(g) for g in groups], prefix=f"{key}_", always_return_tuple=True)
    return _plan(work, {f"{key}_{i}": executor for i in range(len(groups))}, placeholders, gm.graph.nodes)


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    copied = torch.fx.Graph()
    output = copied.graph_copy(graph, {})
    copied.output(output)
    return copied


def _whole(gm: torch.fx.GraphModule, executor: Executor, placeholders: list[torch.fx.Node]) -> Plan:
    returned = list(gm.graph.output_node().args[0])  # type: ignore[arg-type]
    n = len(placeholders)
    step = Step(executor, "whole", gm, list(range(n)), list(range(n, n + len(returned))))
    values = {i: p.meta.get("val") for i, p in enumerate(placeholders)}
    for slot, value in zip(step.outputs, returned, strict=True):
        values[slot] = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
    plan = Plan(n, n + len(returned), [step], [Slot(s) for s in step.outputs], placeholders, True, values)
    plan.frees = _last_reads(plan)
    return plan


def _plan(
    work: torch.fx.GraphModule,
    regions: dict[str, Executor],
    placeholders: list[torch.fx.Node],
    graph_order: Iterable[torch.fx.Node],
) -> Plan:
    slots: dict[torch.fx.Node, int] = {
        p: i for i, p in enumerate(n for n in work.graph.nodes if n.op == "placeholder")
    }
    order = {n.name: i for i, n in enumerate(graph_order)}
    fresh = itertools.count(len(slots))
    constants: dict[int, Any] = {}
    steps: list[Step] = []
    for node in work.graph.nodes:
        if node.op == "call_module":
            region = getattr(work, node.target)  # type: ignore[arg-type]
            _placeholders_first(region)
            _in_graph_order(region, order)
            width = len(region.graph.output_node().args[0])  # type: ignore[arg-type]
            outputs: list[int] = [-1] * width
            for user in node.users:
                if user.target is not operator.getitem:
                    raise AssertionError(f"region {node.target} is read whole by {user.name}")
                slots[user] = outputs[user.args[1]] = next(fresh)  # type: ignore[index]
            # An output nobody reads still needs a place to land.
            outputs = [slot if slot >= 0 else next(fresh) for slot in outputs]
            inputs = [slots[a] for a in node.args]  # type: ignore[index]
            steps.append(Step(regions[node.target], str(node.target), region, inputs, outputs))  # type: ignore[index]
        elif node.op == "get_attr":
            slots[node] = next(fresh)
            constants[slots[node]] = getattr(work, node.target)  # type: ignore[arg-type]
        elif node.op == "call_function" and node.target is operator.getitem:
            if node.args[0].op != "call_module":  # type: ignore[union-attr]
                raise AssertionError(f"{node.name} unpacks a value outside any region")
        elif node.op not in ("placeholder", "output"):
            raise AssertionError(f"node {node.name} belongs to no region")
    plan = Plan(
        num_inputs=len(placeholders),
        num_slots=next(fresh),
        steps=steps,
        outputs=map_aggregate(
            work.graph.output_node().args[0], lambda a: Slot(slots[a]) if isinstance(a, torch.fx.Node) else a
        ),
        placeholders=placeholders,
        whole=False,
        values={slot: node.meta.get("val") for node, slot in slots.items()},
        constants=constants,
    )
    plan.frees = _last_reads(plan)
    return plan


def _placeholders_first(region: torch.fx.GraphModule) -> None:
    """Fusing declares a region's inputs where first used; exporters expect them all up front."""
    placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
    anchor: torch.fx.Node | None = None
    for placeholder in placeholders:
        if anchor is None:
            first = next(iter(region.graph.nodes))
            if first is not placeholder:
                first.prepend(placeholder)
        else:
            anchor.append(placeholder)
        anchor = placeholder
    region.recompile()


def _in_graph_order(region: torch.fx.GraphModule, order: Mapping[str, int]) -> None:
    """A region's nodes in the order of the graph it was cut from.

    Fusing lists a region's nodes in a breadth-first topological order, which interleaves
    independent chains; ONNX Runtime runs a session's nodes in the order given (see
    ``session_options``). A chunked loss then computed every chunk's logits before any chunk's
    reduction, as if it were not chunked (tiny GPT, batch 32: +1.3 GiB in the last forward region
    instead of about 0.2). The captured graph's order is a topological order too, and the one its
    authors (and the chunking) chose.
    """
    compute = [n for n in region.graph.nodes if n.op not in ("placeholder", "output")]
    if any(n.name not in order for n in compute):
        return  # a node the fuser renamed: keep the fuser's order, valid if not the best
    ranked = sorted(compute, key=lambda n: order[n.name])
    if ranked == compute:
        return
    output = region.graph.output_node()
    for node in ranked:
        output.prepend(node)
    region.recompile()


def _last_reads(plan: Plan) -> list[list[int]]:
    returned: set[int] = set()
    map_aggregate(plan.outputs, lambda a: returned.add(a.index) if isinstance(a, Slot) else None)
    last: dict[int, int] = {}
    for position, step in enumerate(plan.steps):
        for slot in step.inputs:
            last[slot] = position
    frees: list[list[int]] = [[] for _ in plan.steps]
    for slot, position in last.items():
        if slot not in returned:
            frees[position].append(slot)
    return frees
