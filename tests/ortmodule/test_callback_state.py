"""A forward that hands values to a callback the model holds (metrics, features for another loss):
the callback's state gets eager's real values at every step, never the capture's traced ones."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ortrain import ORTModule


def _closure_over(store: dict[str, object]) -> Callable[[torch.Tensor], None]:
    def record(value: torch.Tensor) -> None:
        store["mean"] = value

    return record


class _Tracker:
    def __init__(self) -> None:
        self.values: list[float] = []

    def record(self, value: torch.Tensor) -> None:
        self.values.append(value)


# How the model holds its callback, given the dict the test reads back.
_CALLBACKS: dict[str, Callable[[dict[str, object]], object]] = {
    "closure": _closure_over,
    "partial of a slot": lambda store: functools.partial(store.__setitem__, "mean"),
    "lambda": lambda store: lambda value: store.update(mean=value),
    "list of closures": lambda store: [_closure_over(store)],
    "bound method of an object": lambda store: store.setdefault("tracker", _Tracker()).record,
}


class _Reporting(nn.Module):
    def __init__(self, callback: object) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.callback = callback

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        report = self.callback[0] if isinstance(self.callback, list) else self.callback
        report(h.mean().detach())
        return self.fc2(h)


def _reported(store: dict[str, object]) -> torch.Tensor:
    tracker = store.get("tracker")
    return tracker.values[-1] if isinstance(tracker, _Tracker) else store["mean"]


@pytest.mark.parametrize("kind", list(_CALLBACKS))
def test_a_callback_the_model_holds_gets_real_values_at_every_step(kind: str) -> None:
    """Until wave 50 the capture left a FunctionalTensor in the callback's store for good (its
    ``.item()`` raised) and the graph never called the callback again."""
    stores: list[dict[str, object]] = [{}, {}]
    torch.manual_seed(0)
    eager = _Reporting(_CALLBACKS[kind](stores[0]))
    wrapped = ORTModule(_Reporting(_CALLBACKS[kind](stores[1])))
    wrapped.load_state_dict(eager.state_dict())
    for step in range(4):
        x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, step % 3])
        for model in (eager, wrapped):
            nn.functional.cross_entropy(model(x), y).backward()
        got = _reported(stores[1])
        assert type(got) is torch.Tensor  # a real tensor, not a traced one
        assert got.item() == pytest.approx(_reported(stores[0]).item(), rel=1e-6)
    if kind == "bound method of an object":
        assert len(stores[1]["tracker"].values) == len(stores[0]["tracker"].values) == 4


HISTORY: list[torch.Tensor] = []
METRICS: dict[str, list[torch.Tensor]] = {"means": []}


def _append_to_history(value: torch.Tensor) -> None:
    HISTORY.append(value)


class _ReportingNested(nn.Module):
    """Reports through a callback into a dict of lists, and into a list of its module's globals,
    and appends to a module-level dict of lists itself."""

    def __init__(self, store: dict[str, list[torch.Tensor]]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.report = lambda value: store["means"].append(value)
        self.remember = _append_to_history

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.report(h.mean().detach())
        self.remember(h.amax().detach())
        METRICS["means"].append(h.amin().detach())
        return h.square().sum()


def test_lists_inside_a_callbacks_store_and_module_level_tables_get_every_step() -> None:
    """The capture's traced tensors stayed in the inner list (the outer dict looked unchanged),
    and a callback's writes into its module's globals went unseen (wave 50's review)."""
    stores: list[dict[str, list[torch.Tensor]]] = [{"means": []}, {"means": []}]
    torch.manual_seed(0)
    eager = _ReportingNested(stores[0])
    wrapped = ORTModule(_ReportingNested(stores[1]))
    wrapped.load_state_dict(eager.state_dict())
    reported = []
    for _ in range(3):
        x = torch.randn(2, 4)
        for store, model in zip(stores, (eager, wrapped), strict=True):
            del HISTORY[:], METRICS["means"][:]
            for _ in range(2):
                model(x).backward()
            reported.append((list(store["means"]), list(HISTORY), list(METRICS["means"])))
            del store["means"][:]
        for got, expected in zip(reported[-1], reported[-2], strict=True):
            assert len(got) == len(expected) == 2
            assert all(type(t) is torch.Tensor for t in got)
            torch.testing.assert_close(got, expected)


def test_a_model_with_a_callback_that_keeps_nothing_stays_whole() -> None:
    """A callback held by the model but writing nothing (an activation chosen by name) keeps the
    model on one captured graph."""

    def make(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda h: torch.tanh(h) * scale

    class _WithActivation(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = make(2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x)).sum()

    eager = _WithActivation()
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(wrapped(x), eager(x))
    assert wrapped._ortrain_graph_breaks is None and len(wrapped._ortrain_graphs) == 1
