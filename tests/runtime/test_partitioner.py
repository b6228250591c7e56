"""The partitioner on its own: which executor runs each node, and in which region."""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch import nn

from ortrain.capture.aot_capture import capture
from ortrain.runtime.executors.python_op import PythonOpExecutor
from ortrain.runtime.executors.torch import TorchExecutor
from ortrain.runtime.graph_executor import PlanRunner
from ortrain.runtime.partitioner import Plan, partition

aten = torch.ops.aten


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        h = _Double.apply(self.first(x))
        return (self.second(self.norm(h)).sum(),)


class _Claims:
    """A merging executor that claims the nodes whose target is in ``targets`` (a stand-in for ORT)."""

    def __init__(self, name: str, targets: set[object] | None = None, names: set[str] | None = None) -> None:
        self.name = name
        self.merges = True
        self.targets = targets
        self.names = names

    def claims(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if self.names is not None:
            return node.name in self.names
        return self.targets is None or node.target in self.targets

    def refusal(self, node: torch.fx.Node) -> str | None:
        return None if self.claims(node) else "not claimed"

    def build(self, region, *, what, whole):  # runs in PyTorch: the plan is what is under test
        return TorchExecutor().build(region, what=what, whole=whole)


def _plan() -> Plan:
    captured = capture(_Net(), [torch.randn(4, 8)], training=True)
    return partition(captured.forward.graph, [PythonOpExecutor(), _Claims("ort"), TorchExecutor()])


def test_one_python_op_splits_the_forward_into_two_regions() -> None:
    plan = _plan()
    assert [s.executor.name for s in plan.steps] == ["ort", "python op", "ort"]


def test_work_on_graph_inputs_alone_runs_beside_its_reader() -> None:
    # The second Linear's weight transpose depends on a parameter only; it belongs with the
    # matmul after the python op, not in the first region (where it would cross as a copy).
    first, _, last = _plan().steps
    first_targets = [n.target for n in first.nodes]
    last_targets = [n.target for n in last.nodes]
    assert aten.t.default in last_targets and first_targets.count(aten.t.default) == 1
    assert aten.native_layer_norm.default in last_targets
    assert aten.native_layer_norm.default not in first_targets


def test_a_multi_output_op_and_its_getitems_share_a_region() -> None:
    for step in _plan().steps:
        for node in step.nodes:
            if node.target is operator.getitem and node.args[0].op != "placeholder":
                assert node.args[0] in step.nodes


def test_a_graph_one_executor_claims_whole_is_the_original_graph() -> None:
    captured = capture(nn.Linear(4, 4), [torch.randn(2, 4)], training=True)
    plan = partition(captured.forward.graph, [PythonOpExecutor(), _Claims("ort"), TorchExecutor()])
    assert plan.whole and len(plan.steps) == 1 and plan.steps[0].region is captured.forward.graph


def test_layout_only_regions_go_to_the_next_executor() -> None:
    # ORT would get only the transpose between two torch matmuls: not worth a boundary.
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    a = graph.call_function(aten.mm.default, (x, w))
    t = graph.call_function(aten.t.default, (a,))
    b = graph.call_function(aten.mm.default, (t, w))
    graph.output((b,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    plan = partition(gm, [_Claims("ort", {aten.t.default}), TorchExecutor()])
    assert [s.executor.name for s in plan.steps] == ["torch"]


def test_a_region_runs_its_nodes_in_the_graph_order() -> None:
    """Two independent chains (chunks of a loss, say) stay chain after chain, not interleaved
    breadth-first: ONNX Runtime runs a region's nodes in the given order, and an interleaved order
    keeps every chain's intermediates alive at once."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ends = []
    for chain in "ab":
        value = x
        for i in range(3):
            value = graph.call_function(aten.neg.default, (value,), name=f"{chain}{i}")
        ends.append(value)
    total = graph.call_function(aten.add.Tensor, tuple(ends), name="total")
    after = graph.call_function(aten.relu.default, (total,), name="after")  # a second region
    graph.output((after,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    claimed = {"a0", "a1", "a2", "b0", "b1", "b2", "total"}
    plan = partition(gm, [_Claims("ort", names=claimed), TorchExecutor()])
    (ort,) = [s for s in plan.steps if s.executor.name == "ort"]
    assert [n.name for n in ort.nodes] == ["a0", "a1", "a2", "b0", "b1", "b2", "total"]


def test_a_node_feeding_only_outputs_runs_in_the_region_of_its_inputs() -> None:
    """A weight gradient's product feeds only the output: it runs where its input is made, not in
    the last region, so that its input (an activation-sized gradient) dies early."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    grad = graph.call_function(aten.neg.default, (x,), name="grad")
    crossing = graph.call_function(aten.relu.default, (grad,), name="crossing")  # torch's: a cut
    later = graph.call_function(aten.neg.default, (crossing,), name="later")
    weight_grad = graph.call_function(aten.mul.Tensor, (grad, x), name="weight_grad")
    graph.output((later, weight_grad))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    plan = partition(gm, [_Claims("ort", names={"grad", "later", "weight_grad"}), TorchExecutor()])
    regions = {n.name: step.name for step in plan.steps for n in step.nodes}
    assert regions["weight_grad"] == regions["grad"] != regions["later"]
    # The value "grad" is freed right after the crossing reads it, not kept for a later region.
    runners = [s.executor.build(s.region, what=s.name, whole=plan.whole) for s in plan.steps]
    args = [torch.randn(4)]
    for got, want in zip(PlanRunner(plan, runners)(list(args)), gm(*args), strict=True):
        torch.testing.assert_close(got, want)


def _random_graph(rng: random.Random, size: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    values = [graph.placeholder(f"x{i}") for i in range(rng.randint(1, 3))]
    ops = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor]
    for _ in range(size):
        if rng.random() < 0.2:
            values.append(graph.call_function(aten.neg.default, (rng.choice(values),)))
        else:
            values.append(graph.call_function(rng.choice(ops), (rng.choice(values), rng.choice(values))))
    unread = [v for v in values if not v.users and v.op != "placeholder"]
    graph.output(tuple(unread or values[-1:]))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("seed", range(40))
def test_random_dags_partition_without_cycles_and_compute_the_same(seed: int) -> None:
    rng = random.Random(seed)
    gm = _random_graph(rng, rng.randint(4, 40))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    first = set(rng.sample(names, k=rng.randint(0, len(names))))
    second = set(rng.sample(names, k=rng.randint(0, len(names)))) - first
    executors = [_Claims("a", names=first), _Claims("b", names=second), TorchExecutor()]
    plan = partition(gm, executors)
    # Each region reads only graph inputs and values earlier regions made: no cycle among regions.
    ready = set(range(plan.num_inputs))
    for step in plan.steps:
        assert set(step.inputs) <= ready, f"seed {seed}: region {step.name} reads a later value"
        ready |= set(step.outputs)
    ran = [
        n.name
        for s in plan.steps
        for n in s.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    ]
    assert sorted(ran) == sorted(names)
    position = {name: i for i, name in enumerate(n.name for n in gm.graph.nodes)}
    for step in plan.steps:  # a node runs in the executor that claimed it (or the next, if layout-only)
        ranks = [position[n.name] for n in step.nodes]
        assert ranks == sorted(ranks), f"seed {seed}: region {step.name} reorders the graph"
        for node in step.nodes:
            if step.executor.name == "a":
                assert node.name in first
    runners = [s.executor.build(s.region, what=s.name, whole=plan.whole) for s in plan.steps]
    args = [torch.randn(3) for _ in range(plan.num_inputs)]
    expected = gm(*args)
    for got, want in zip(PlanRunner(plan, runners)(list(args)), expected, strict=True):
        torch.testing.assert_close(got, want)
