"""A forward that returns ``torch.distributions`` objects (a policy's API): they come out of the
graph by their tensors, rebuilt as the forward built them, with eager's gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributions as dist
from torch import nn

from ortrain import ORTModule


def _tanh_normal(h: torch.Tensor) -> dist.Distribution:
    base = dist.Normal(h[:, :3], h[:, 3:].exp())
    return dist.TransformedDistribution(base, [dist.transforms.TanhTransform()])


def _lower_triangular(h: torch.Tensor) -> dist.Distribution:
    scale = torch.diag_embed(h[:, 3:].exp()) + torch.tril(h[:, :3, None] * h[:, None, :3], -1)
    return dist.MultivariateNormal(h[:, :3], scale_tril=scale)


# Each head maps the (5, 6) activation to a distribution, with a value to score and whether the
# distribution has a closed-form entropy.
_HEADS: dict[str, tuple[Callable[[torch.Tensor], dist.Distribution], torch.Tensor, bool]] = {
    "normal": (lambda h: dist.Normal(h[:, :3], h[:, 3:].exp()), torch.full((5, 3), 0.3), True),
    "independent": (
        lambda h: dist.Independent(dist.Normal(h[:, :3], h[:, 3:].exp()), 1),
        torch.full((5, 3), 0.3),
        True,
    ),
    "tanh normal": (_tanh_normal, torch.full((5, 3), 0.3), False),
    "multivariate normal": (_lower_triangular, torch.full((5, 3), 0.3), True),
    "categorical": (lambda h: dist.Categorical(logits=h), torch.arange(5) % 6, True),
    "categorical of probabilities": (lambda h: dist.Categorical(probs=h.softmax(-1)), torch.arange(5), True),
    "beta": (lambda h: dist.Beta(h[:, :3].exp(), h[:, 3:].exp()), torch.full((5, 3), 0.3), True),
    "bernoulli": (lambda h: dist.Bernoulli(logits=h), (torch.arange(30.0) % 2).reshape(5, 6), True),
    "mixture": (
        lambda h: dist.MixtureSameFamily(
            dist.Categorical(logits=h[:, :3]), dist.Normal(h[:, 3:], torch.ones(3))
        ),
        torch.full((5,), 0.3),
        False,
    ),
}


class _Policy(nn.Module):
    def __init__(self, head: Callable[[torch.Tensor], dist.Distribution]) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = head

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.body(x)
        return {"policy": self.head(h), "value": h.sum(-1)}


@pytest.mark.parametrize("name", list(_HEADS))
def test_a_returned_distribution_trains_as_in_eager(name: str) -> None:
    """Until wave 50 the output was refused and the model trained in PyTorch after a warning."""
    head, value, has_entropy = _HEADS[name]
    torch.manual_seed(0)
    eager = _Policy(head).double()
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, wrapped)]
    x = torch.randn(5, 4, dtype=torch.float64)
    value = value.double() if value.is_floating_point() else value
    for _ in range(3):
        for model, optimizer in zip((eager, wrapped), optimizers, strict=True):
            optimizer.zero_grad()
            out = model(x)
            policy = out["policy"]
            assert type(policy) is type(head(torch.zeros(5, 6, dtype=torch.float64)))
            loss = -policy.log_prob(value).sum() + out["value"].square().mean()
            if has_entropy:
                loss = loss - 0.1 * policy.entropy().sum()
            loss.backward()
            optimizer.step()
            model.last_loss = loss.detach()
        torch.testing.assert_close(wrapped.last_loss, eager.last_loss)
        torch.testing.assert_close(wrapped.module.body.weight.grad, eager.body.weight.grad)
    torch.testing.assert_close(wrapped.module.body.weight, eager.body.weight)


def test_a_rebuilt_distribution_keeps_its_shapes_and_samples_with_gradients() -> None:
    torch.manual_seed(0)
    eager = _Policy(_HEADS["independent"][0])
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 4)
    policies = [m(x)["policy"] for m in (eager, wrapped)]
    assert policies[1].batch_shape == policies[0].batch_shape == (5,)
    assert policies[1].event_shape == policies[0].event_shape == (3,)
    samples = []
    for policy in policies:
        torch.manual_seed(1)
        samples.append(policy.rsample())
    torch.testing.assert_close(samples[1], samples[0])
    samples[1].sum().backward()
    samples[0].sum().backward()
    torch.testing.assert_close(wrapped.module.body.weight.grad, eager.body.weight.grad)


def test_a_rebuilt_distribution_checks_its_arguments_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks are off while ortrain traces; the rebuilt object runs them, as eager's
    constructor does: a negative scale is eager's ValueError, not a distribution of NaNs."""
    monkeypatch.setattr(dist.Distribution, "_validate_args", True)
    wrapped = ORTModule(_Policy(lambda h: dist.Normal(h[:, :3], h[:, 3:])))
    with torch.no_grad():
        wrapped.module.body.bias[3:] = -10.0
    with pytest.raises(ValueError, match="scale"):
        wrapped(torch.zeros(5, 4))
    with torch.no_grad():
        wrapped.module.body.bias[3:] = 10.0
    assert wrapped(torch.zeros(5, 4))["policy"].scale.min() > 0


def test_a_distribution_passes_in_as_an_argument() -> None:
    """A prior handed to the forward (a KL term against it)."""

    class _Regularized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor, prior: dist.Normal) -> torch.Tensor:
            h = self.body(x)
            return dist.kl_divergence(dist.Normal(h[:, :3], h[:, 3:].exp()), prior).sum()

    torch.manual_seed(0)
    eager = _Regularized()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 4)
    for scale in (1.0, 2.0):
        prior = dist.Normal(torch.zeros(3), torch.full((3,), scale))
        losses = [m(x, prior) for m in (eager, wrapped)]
        torch.testing.assert_close(losses[1], losses[0])


class _ScoredSquashedPolicy(nn.Module):
    """A SAC actor that scores an action inside the forward (which builds the transform's
    inverse) and returns the distribution too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, action: torch.Tensor) -> tuple[dist.Distribution, torch.Tensor]:
        policy = _tanh_normal(self.body(x))
        return policy, policy.log_prob(action).sum()


def test_a_transform_whose_inverse_was_built_passes_out_and_in() -> None:
    """torch 2.13 keeps a transform and its inverse pointing at each other: the capture recursed
    without end (a RecursionError, and the model trained in PyTorch; wave 50's review)."""
    torch.manual_seed(0)
    eager = _ScoredSquashedPolicy()
    wrapped = ORTModule(copy.deepcopy(eager))
    x, action = torch.randn(5, 4), torch.full((5, 3), 0.3)
    results = [m(x, action) for m in (eager, wrapped)]
    torch.testing.assert_close(results[1][1], results[0][1])
    for policy, score in results:
        (score - policy.log_prob(action.flip(0)).sum()).backward()
    torch.testing.assert_close(wrapped.module.body.weight.grad, eager.body.weight.grad, rtol=1e-5, atol=1e-6)
    assert results[1][0].transforms[0].inv.inv is results[1][0].transforms[0]
