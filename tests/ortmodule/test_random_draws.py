"""Random numbers drawn inside a forward are eager's: sampling from distributions (mixup's Beta, a
Gamma's reparametrised sample, Dirichlet, Binomial), ``random_``, and forwards that set the
generator themselves (``manual_seed``, ``set_rng_state``, ``fork_rng``)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.capture.generator_resets import GeneratorResetError, refusing_generator_resets, user_forward


def _trains_like_eager(model: nn.Module) -> ORTModule:
    """Three SGD steps of ``model`` and of an ORTModule of a copy, the generator seeded alike
    before each: the same losses and parameters. Returns the wrapper."""
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    for step in range(3):
        losses = []
        for module, optimizer in ((eager, eager_opt), (wrapped, opt)):
            torch.manual_seed(step)
            loss = module(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
    for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    return wrapped


class _Sampling(nn.Module):
    """A draw in one chain and a dropout in another: the draws must also keep eager's order."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 6)

    def _draw(self) -> torch.Tensor:
        if self.kind == "beta":
            return torch.distributions.Beta(torch.full((8, 1), 0.4), torch.full((8, 1), 0.4)).sample()
        if self.kind == "gamma":
            return torch.distributions.Gamma(torch.full((8, 1), 2.0), torch.ones(8, 1)).rsample()
        if self.kind == "dirichlet":
            return torch.distributions.Dirichlet(torch.ones(8, 6)).sample()
        if self.kind == "binomial":
            return torch.distributions.Binomial(5, torch.full((8, 1), 0.3)).sample()
        return torch.empty(8, 1).random_(0, 4)  # "random_"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)) * self._draw()
        g = nn.functional.dropout(torch.tanh(self.second(x)), 0.3)
        return (h + g).square().mean()


@pytest.mark.parametrize("kind", ["beta", "gamma", "dirichlet", "binomial", "random_"])
def test_sampling_in_the_forward_draws_eagers_numbers(kind: str) -> None:
    """Gamma, Dirichlet and Binomial sampling had no ONNX translation and were not known as random:
    under FALLBACK_DISABLE the model was refused, elsewhere they ran in PyTorch with a warning and
    outside the ordering of draws. ``random_(low, high)`` is traced as ``aten.random.from``, which
    torch.fx writes into a region's code as ``torch.ops.aten.random.from(...)``: a SyntaxError."""
    torch.manual_seed(0)
    wrapped = _trains_like_eager(_Sampling(kind))
    # On ortrain's graphs (Beta's argument checks send it through graph breaks), not PyTorch's.
    assert not wrapped._ortrain_fallback.active


class _InPlaceDraws(nn.Module):
    """Draws written in place: a noise layer filling a tensor, a buffer re-drawn each step, RReLU."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(6, 6)
        self.register_buffer("offset", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.kind == "normal_":  # Gaussian noise injection
            h = h + torch.empty_like(h).normal_(0.0, 0.1)
        elif self.kind == "init.normal_":
            with torch.no_grad():
                nn.init.normal_(self.offset)
            h = h + self.offset
        else:  # "rrelu_"
            h = nn.functional.rrelu(h, training=True, inplace=True)
        return h.square().mean()


@pytest.mark.parametrize("kind", ["normal_", "init.normal_", "rrelu_"])
def test_draws_in_place_are_eagers_numbers(kind: str) -> None:
    """Wave 23: an in-place draw is ``normal_functional`` / ``rrelu_with_noise_functional`` in the
    graph, which were not known as random: ONNX Runtime drew them with its own generator from the
    third step on (the first two run the graph in PyTorch), so the noise was not eager's and
    PyTorch's generator was left where it was."""
    torch.manual_seed(0)
    wrapped = _trains_like_eager(_InPlaceDraws(kind))
    assert not wrapped._ortrain_fallback.active


class _Reseeding(nn.Module):
    """Forwards that set PyTorch's generator, as people write them."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "manual_seed":  # the same mask at every step
            torch.manual_seed(123)
            return nn.functional.dropout(self.linear(x), 0.5).square().mean()
        if self.kind == "replay":  # one mask drawn twice, as reversible layers do
            state = torch.get_rng_state()
            first = nn.functional.dropout(self.linear(x), 0.5)
            torch.set_rng_state(state)
            return (first * nn.functional.dropout(self.linear(2 * x), 0.5)).mean()
        with torch.random.fork_rng():  # "fork_rng": these numbers are drawn again after it
            noise = torch.randn_like(x)
        return nn.functional.dropout(self.linear(x + noise), 0.3).square().mean()


@pytest.mark.parametrize("kind", ["manual_seed", "replay", "fork_rng"])
def test_a_forward_that_sets_the_generator_trains_like_eager(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The captured graph set the generator once, while it was traced, and drew other masks than
    eager's at every step (step 0's gradients off by 0.02-0.05): the model trained on another
    function than the one written. Now such a capture is refused and the model trains through
    TorchDynamo's graph breaks, which call these functions at every step (``fork_rng``, a context
    manager TorchDynamo cannot enter, gives the forward up to eager PyTorch whole: the default
    policy allows that with a warning)."""
    if kind == "fork_rng":
        monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    wrapped = _trains_like_eager(_Reseeding(kind))
    assert wrapped._ortrain_graph_breaks is not None and not wrapped._ortrain_fallback.active


def test_generator_resets_are_named_and_the_functions_put_back() -> None:
    # Each namespace gets its own function back: importing TorchDynamo replaces torch.manual_seed
    # (not torch.random's) with a wrapper that keeps Dynamo out of it.
    names = ("manual_seed", "set_rng_state", "seed")
    setters = [getattr(namespace, name) for namespace in (torch, torch.random) for name in names]
    with pytest.raises(GeneratorResetError, match=r"torch\.manual_seed, torch\.set_rng_state"):
        with refusing_generator_resets(), user_forward():
            state = torch.get_rng_state()
            torch.manual_seed(3)
            torch.set_rng_state(state)
    assert [getattr(namespace, name) for namespace in (torch, torch.random) for name in names] == setters
    with refusing_generator_resets():
        with user_forward():  # drawing and reading the state set nothing
            torch.get_rng_state()
            torch.rand(3)
        # Outside the user's forward (AOTAutograd around its traces, ortrain's trial runs).
        with torch.random.fork_rng():
            torch.manual_seed(5)


def test_a_scripts_own_seed_function_is_watched_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that makes ``torch.seed`` repeatable (Reformer reseeds every layer with
    ``torch.seed()``) replaces ``torch.seed`` but not ``torch.random.seed``. Putting the functions
    back used to set both names to ``torch.random``'s: after the first capture the script's
    function was gone and the forward drew unrepeatable seeds (losses differing from run to run)."""
    calls: list[int] = []

    def repeatable_seed() -> int:
        calls.append(1)
        return int(torch.randint(0, 2**62, (1,)).item())

    monkeypatch.setattr(torch, "seed", repeatable_seed)
    with pytest.raises(GeneratorResetError, match=r"torch\.seed"):
        with refusing_generator_resets(), user_forward():
            torch.seed()
    assert calls == [1]
    assert torch.seed is repeatable_seed
    assert torch.random.seed is not repeatable_seed


class _UnusedDropout(nn.Module):
    def __init__(self, draws_unused: bool) -> None:
        super().__init__()
        self.draws_unused = draws_unused
        self.linear = nn.Linear(6, 6)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.draws_unused:
            self.dropout(h)  # computed, never read
        return self.dropout(torch.tanh(h)).square().mean()


def test_a_draw_the_forward_never_uses_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """AOTAutograd's partitioner failed on the unread dropout ("Expected native_dropout to be a
    tensor") and the model trained in PyTorch. It is left out now, as torch.compile's graphs leave
    it out: the model trains like eager PyTorch without the unused call, and says so once."""
    torch.manual_seed(0)
    eager = _UnusedDropout(draws_unused=False)
    wrapped = ORTModule(_UnusedDropout(draws_unused=True))
    wrapped.load_state_dict(eager.state_dict())
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for step in range(3):
            losses = []
            for module in (eager, wrapped):
                module.zero_grad()
                torch.manual_seed(step)
                loss = module(torch.randn(8, 6, generator=torch.Generator().manual_seed(step)))
                loss.backward()
                losses.append(loss)
            torch.testing.assert_close(losses[1], losses[0])
            for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad)
    assert not wrapped._ortrain_fallback.active
    warned = [r.getMessage() for r in caplog.records if "never uses" in r.getMessage()]
    assert len(warned) == 1 and "aten.native_dropout.default" in warned[0]
