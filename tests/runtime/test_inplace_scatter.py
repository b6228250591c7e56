"""Functional scatters into a buffer the graph made run in place in PyTorch, and only those."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.runtime.executors.torch import TorchExecutor
from ortrain.runtime.inplace_scatter import scatter_in_place

aten = torch.ops.aten


def _repad(rows: torch.Tensor, index: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A padded batch made whole again, and a gather's gradient: both scatter into fresh zeros."""
    padded = rows.new_zeros(8, rows.shape[1]).index_copy(0, index, rows)
    summed = rows.new_zeros(rows.shape).index_add(0, torch.zeros_like(index), grad)
    return padded, summed


def _with_reused_buffer(rows: torch.Tensor, index: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, ...]:
    zeros = rows.new_zeros(8, rows.shape[1])
    return zeros.index_copy(0, index, rows), zeros  # the zeros are an output too


def _args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(3, 5), torch.tensor([6, 0, 3]), torch.randn(3, 5)


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_scatters_into_fresh_zeros_run_in_place_with_the_same_values() -> None:
    gm = make_fx(_repad)(*_args())
    changed = scatter_in_place(gm)
    assert changed is not gm
    assert aten.index_copy_.default in _targets(changed) and aten.index_add_.default in _targets(changed)
    assert aten.index_copy_.default not in _targets(gm)  # the captured graph stays functional
    args = _args()
    for got, want in zip(changed(*args), _repad(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_a_buffer_something_else_reads_is_not_written_in_place() -> None:
    gm = make_fx(_with_reused_buffer)(*_args())
    assert scatter_in_place(gm) is gm
    padded, zeros = TorchExecutor().build(gm, what="test", whole=True)(list(_args()))
    assert torch.count_nonzero(zeros) == 0 and torch.count_nonzero(padded) > 0


def test_the_torch_executor_runs_the_in_place_graph() -> None:
    gm = make_fx(_repad)(*_args())
    run = TorchExecutor().build(gm, what="test", whole=True)
    assert aten.index_copy_.default in _targets(run.region)  # type: ignore[attr-defined]
    args = _args()
    for got, want in zip(run(list(args)), _repad(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_the_torch_executor_leaves_the_graph_it_is_given_as_it_was() -> None:
    """A whole graph the torch executor builds is the one op tuning's default placement exports
    later: until wave 43 its views were turned into reshapes in place, and that export baked a
    size of the capture into a Reshape (a ResNet's backward failed at its sixth step)."""
    gm = make_fx(lambda x: (x.t().contiguous().view(-1) * 2,))(torch.randn(3, 4))
    targets = [n.target for n in gm.graph.nodes]
    run = TorchExecutor().build(gm, what="test", whole=True)
    assert [n.target for n in gm.graph.nodes] == targets
    x = torch.randn(3, 4)
    torch.testing.assert_close(run([x])[0], x.t().reshape(-1) * 2)
