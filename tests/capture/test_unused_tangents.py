"""A region without its unused output gradients: what they make zero is not computed."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ortrain.capture.unused_tangents import without_inputs

aten = torch.ops.aten


def _region() -> torch.fx.GraphModule:
    """The head's backward, as a region: the logits' gradient (a tangent) through a view into the
    weight gradient's and the input gradient's matmuls, each added to another contribution."""
    graph = torch.fx.Graph()
    tangent, x, w, other = (graph.placeholder(n) for n in ("tangents_1", "x", "w", "other"))
    values = {
        tangent: torch.empty(2, 3, 5),
        x: torch.empty(6, 4),
        w: torch.empty(5, 4),
        other: torch.empty(6, 4),
    }
    for node, value in values.items():
        node.meta["val"] = value
    flat = graph.call_function(aten.view.default, (tangent, [6, 5]))
    grad_x = graph.call_function(aten.mm.default, (flat, w))
    summed = graph.call_function(aten.add.Tensor, (grad_x, other))
    grad_w = graph.call_function(aten.mm.default, (graph.call_function(aten.t.default, (flat,)), x))
    doubled = graph.call_function(aten.mul.Tensor, (x, 2.0))  # reads no zero: kept
    graph.output((summed, grad_w, flat, doubled))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    torch.fx.passes.shape_prop.ShapeProp(gm).propagate(*(torch.randn(v.shape) for v in values.values()))
    for node in gm.graph.nodes:  # ShapeProp writes tensor_meta; the capture's graphs carry val
        if node.op != "output" and "val" not in node.meta:
            meta = node.meta["tensor_meta"]
            node.meta["val"] = torch.empty(meta.shape, dtype=meta.dtype)
    return gm


def test_zero_gradient_products_are_not_computed_and_zero_outputs_leave() -> None:
    region = without_inputs(_region(), {0})
    assert region is not None
    targets = [n.target for n in region.graph.nodes if n.op == "call_function"]
    assert aten.mm.default not in targets and aten.add.Tensor not in targets
    # The weight gradient and the flattened gradient are zero: they leave as None (positions 1, 2).
    assert region.meta["zero_outputs"] == frozenset({1, 2})
    x, w, other = torch.randn(6, 4), torch.randn(5, 4), torch.randn(6, 4)
    summed, doubled = region(x, w, other)
    torch.testing.assert_close(summed, other)  # mm(zeros, w) + other
    torch.testing.assert_close(doubled, x * 2)


def test_the_same_region_with_its_gradient_is_untouched() -> None:
    region = without_inputs(_region(), set())
    assert region is not None and region.meta["zero_outputs"] == frozenset()
    assert sum(n.target is aten.mm.default for n in region.graph.nodes) == 2


def _sparse_head_backward(
    tangent: torch.Tensor, x: torch.Tensor, keep: torch.Tensor, w: torch.Tensor, other: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A head run on the kept rows only (label sparsity, padding elimination): its gradients pass
    through values whose row count depends on the data."""
    index = keep.nonzero().view(-1)
    rows_grad = tangent.index_select(0, index)
    grad_w = rows_grad.t().mm(x.index_select(0, index)) + other  # the zero product is dropped
    grad_x = x.new_zeros(x.shape).index_copy(0, index, rows_grad.mm(w))  # a scatter reads it
    return grad_w, grad_x


def test_zeros_of_a_data_dependent_size_are_skipped_or_computed_from_zeros() -> None:
    keep = torch.tensor([True, False, True, True, False, True])
    real = (torch.randn(6, 5), torch.randn(6, 4), keep, torch.randn(5, 4), torch.randn(5, 4))
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in real]
    region = without_inputs(make_fx(_sparse_head_backward, tracing_mode="symbolic")(*fakes), {0})
    assert region is not None
    # The weight gradient's product is not computed; the one the scatter reads is, from zeros.
    assert sum(n.target is aten.mm.default for n in region.graph.nodes) == 1
    grad_w, grad_x = region(*real[1:])
    torch.testing.assert_close(grad_w, real[4])
    assert torch.count_nonzero(grad_x) == 0


def test_several_missing_gradients_that_must_exist_become_zeros() -> None:
    """Two missing inputs, each read by something that is not zero (a scatter, an output with
    something else): both are made as zeros, whichever order they come in."""
    graph = torch.fx.Graph()
    # AOTAutograd puts the tangents last.
    x, index, first, second = (graph.placeholder(n) for n in ("x", "index", "tangents_1", "tangents_2"))
    for node in (first, second, x):
        node.meta["val"] = torch.empty(4, 3)
    index.meta["val"] = torch.empty(4, dtype=torch.long)
    scattered = graph.call_function(aten.index_copy.default, (x, 0, index, first))
    scattered.meta["val"] = torch.empty(4, 3)
    joined = graph.call_function(aten.cat.default, ([second, x],))
    joined.meta["val"] = torch.empty(8, 3)
    graph.output((scattered, joined))
    for positions in ({2, 3}, {3, 2}):
        region = without_inputs(torch.fx.GraphModule(torch.nn.Module(), graph), positions)
        assert region is not None
        x_value = torch.randn(4, 3)
        scattered_value, joined_value = region(x_value, torch.tensor([2, 0, 3, 1]))
        want = torch.zeros(4, 3)  # every row scattered from the zero gradient
        torch.testing.assert_close(scattered_value, want)
        torch.testing.assert_close(joined_value, torch.cat([torch.zeros(4, 3), x_value]))


def _kept_rows_gradient(tangent: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows_grad = tangent.index_select(0, keep.nonzero().view(-1))  # as many rows as are kept
    return rows_grad, tangent.sum(0)


def test_a_zero_of_a_data_dependent_size_does_not_leave_as_none() -> None:
    """A region's zero output leaves as None and its reader may have to make it; one whose size
    only this region's data gives is computed (as zeros) instead."""
    keep = torch.tensor([True, False, True, True, False, True])
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in (torch.randn(6, 5), keep)]
    region = without_inputs(make_fx(_kept_rows_gradient, tracing_mode="symbolic")(*fakes), {0})
    assert region is not None and region.meta["zero_outputs"] == frozenset({1})
    (rows_grad,) = region(keep)
    torch.testing.assert_close(rows_grad, torch.zeros(4, 5))


def _logit_backward(
    used: torch.Tensor, missing: torch.Tensor, p: torch.Tensor, outside: torch.Tensor
) -> tuple[torch.Tensor]:
    """The probabilities' gradient from the loss and from ``logit(p)`` (an output only logged):
    logit's derivative 1 / (p (1 - p)) is infinite where a probability underflowed to 0."""
    masked = torch.where(outside, torch.full_like(missing, float("nan")), missing)
    return (used + masked / (p * (1 - p)),)


def test_a_missing_gradient_meets_no_infinite_derivative() -> None:
    """What only the missing gradient reaches is zero whatever the operator (a ``where`` here), not
    computed from zeros: eager never runs the unused output's backward, and 0 / 0 is NaN."""
    p = torch.tensor([0.0, 0.25, 0.5])
    used, outside = torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, dtype=torch.bool)
    graph = make_fx(_logit_backward)(used, torch.zeros(3), p, outside)
    region = without_inputs(graph, {1}, carriers={0})
    assert region is not None
    assert not any(n.target in (aten.where.self, aten.div.Tensor) for n in region.graph.nodes)
    (gradient,) = region(used, p, outside)
    torch.testing.assert_close(gradient, used)
    # Not told which inputs hold gradients, it takes every one for a gradient: the ``where`` then
    # mixes the missing gradient with the mask, its zeros are made and divided by 0.
    conservative = without_inputs(graph, {1})
    assert conservative is not None
    assert torch.isnan(conservative(used, p, outside)[0][0])
