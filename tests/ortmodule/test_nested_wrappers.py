"""An ORTModule inside a model that is wrapped again: the outer capture traces through it."""

from __future__ import annotations

import copy

import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn

from ortrain import ORTModule


def test_a_wrapped_submodule_becomes_part_of_the_outer_graph() -> None:
    """Wave 15: under FALLBACK_DISABLE the capture failed ("invalid python storage": the inner
    wrapper captured and ran its own graphs on traced values); under the default policy the inner
    wrapper fell back to PyTorch for good and the outer failed at every step (IndexError)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(nn.Linear(4, 4), ORTModule(inner), nn.Linear(4, 2))
    batches = [torch.randn(3, 4) for _ in range(3)]
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x).square().mean())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-6)
    assert len(wrapped._ortrain_graphs) == 1
    assert len(model[1]._ortrain_graphs) == 0  # the inner wrapper never captured: it was traced through
    # On its own, the inner wrapper still trains on its graphs.
    x = torch.randn(3, 4, requires_grad=True)
    model[1](x).sum().backward()
    expected_grad = torch.func.grad(lambda v: copy.deepcopy(inner)(v).sum())(x.detach())
    torch.testing.assert_close(x.grad, expected_grad)
    assert len(model[1]._ortrain_graphs) == 1


def test_a_wrapper_wrapped_again_trains_like_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    eager = copy.deepcopy(model)
    twice = ORTModule(ORTModule(model))
    assert dict(twice.named_parameters()).keys() == dict(eager.named_parameters()).keys()
    for module in (twice, eager):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(3):
            optimizer.zero_grad()
            module(torch.randn(5, 4)).square().mean().backward()
            optimizer.step()
    assert_same_state(twice, eager, atol=1e-6)
    assert len(twice._ortrain_graphs) == 1


def _doubled(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    return output * 2


def test_a_wrapped_submodule_on_the_graph_break_path_trains_like_eager() -> None:
    """Wave 49's review: a hook of the user's sends the outer model to TorchDynamo's graph breaks,
    which traced into the inner wrapper's lock and refused the model ("Dynamo does not know how
    to enter a RLock")."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), ORTModule(nn.Sequential(nn.Linear(4, 4), nn.Tanh())), nn.Linear(4, 2)
    )
    model[2].register_forward_hook(_doubled)
    batches = [torch.randn(3, 4) for _ in range(3)]
    losses, expected, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x).square().mean())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-6)
    assert wrapped._ortrain_graph_breaks is not None
