"""The guards watch the attributes of held objects that the captures read, and only those
(ortrain/capture/attribute_reads.py): a meter the loop updates at every step captures nothing, a
value the forward reads is seen whichever way it is read."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _parity import assert_same_state
from torch import nn

from ortrain import ORTModule
from ortrain.capture.attribute_reads import AttributeReads

_HELD = "(an object held by '(the model)')"


class _Meter:
    """What a training loop updates at every step and the forward never reads."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, value: float) -> None:
        self.total += value
        self.count += 1


class _Peaked:
    high: float

    def peak(self) -> float:
        return self.high


class _Schedule(_Peaked):
    def __init__(self) -> None:
        self.warm = True
        self.low = 0.5
        self.high = 2.0
        self._scale = 1.0
        self.epoch = 0  # the loop's: never read by the forward

    @property
    def scale(self) -> float:  # read through a property: its body's lookups count
        return self._scale * (self.low if self.warm else self.high)


class _Progress:
    def __init__(self) -> None:
        self.step = 0
        self.seen = 0


class _Trainer:
    def __init__(self) -> None:
        self.progress = _Progress()
        self.logs: list[str] = []


@dataclasses.dataclass
class _RunState:
    """A dataclass the model holds, read as a config: its counter changes at every step."""

    gamma: float = 1.0
    step: int = 0


class _Net(nn.Module):
    def __init__(self, read: Callable[[_Net], float]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.meter = _Meter()
        self.schedule = _Schedule()
        self.trainer = _Trainer()
        self.run = _RunState()
        self._read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self._read(self)).square().mean()


def _train(
    read: Callable[[_Net], float],
    changes: dict[int, Callable[[_Net], None]],
    caplog: pytest.LogCaptureFixture,
    steps: int = 6,
) -> list[str]:
    """Train an ORTModule and an eager copy through ``changes`` (the meter, the run state's step
    and the trainer's progress move at every step); returns why each capture happened."""
    torch.manual_seed(0)
    model = _Net(read)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(steps):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            losses = []
            for m in (wrapped.module, eager):
                if step in changes:
                    changes[step](m)
            for m in (wrapped, eager):
                inner = m.module if isinstance(m, ORTModule) else m
                loss = m(x)
                loss.backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
                inner.meter.update(loss.item())
                inner.run.step += 1
                inner.trainer.progress.seen += 3
                losses.append(loss.item())
            assert losses[0] == pytest.approx(losses[1], rel=1e-5), f"step {step}"
    assert_same_state(wrapped, eager, atol=1e-5)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]


def test_values_the_forward_never_reads_capture_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Until wave 31 the meter's count, the run state's step and the trainer's progress each
    captured the model again, at every step."""

    def epoch(m: _Net) -> None:
        m.schedule.epoch += 1

    reasons = _train(lambda m: m.schedule.scale, {2: epoch, 3: epoch}, caplog)
    assert reasons == ["capturing a graph: first call"]


def test_a_value_read_through_a_property_is_seen(caplog: pytest.LogCaptureFixture) -> None:
    def scale(m: _Net) -> None:
        m.schedule._scale = 3.0

    reasons = _train(lambda m: m.schedule.scale, {2: scale}, caplog)
    assert reasons[1] == f"capturing a graph: schedule._scale changed from 1.0 to 3.0 {_HELD}"
    assert len(reasons) == 2


def test_the_branch_a_value_chooses_is_seen_and_its_reads_are_added(caplog: pytest.LogCaptureFixture) -> None:
    """The first capture reads ``low`` (``warm`` is True), not ``high``: a change to ``high`` then
    captures nothing; once ``warm`` flips, ``high`` is read and watched."""

    def high(value: float) -> Callable[[_Net], None]:
        def change(m: _Net) -> None:
            m.schedule.high = value

        return change

    def cool(m: _Net) -> None:
        m.schedule.warm = False

    reasons = _train(lambda m: m.schedule.scale, {1: high(3.0), 2: cool, 4: high(4.0)}, caplog)
    assert reasons == [
        "capturing a graph: first call",
        f"capturing a graph: schedule.warm changed from True to False {_HELD}",
        f"capturing a graph: schedule.high changed from 3.0 to 4.0 {_HELD}",
    ]


def test_a_nested_object_and_a_dataclass_are_watched_by_their_reads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def step(m: _Net) -> None:
        m.trainer.progress.step = 5

    def gamma(m: _Net) -> None:
        m.run.gamma = 0.5

    reasons = _train(lambda m: m.run.gamma + 0.1 * m.trainer.progress.step, {2: step, 4: gamma}, caplog)
    assert reasons[1] == (f"capturing a graph: trainer.progress.step changed from 0 to 5 {_HELD}")
    assert reasons[2].startswith("capturing a graph: run") and "gamma" in reasons[2]
    assert len(reasons) == 3


def test_an_attribute_read_while_absent_is_seen_when_set(caplog: pytest.LogCaptureFixture) -> None:
    def boost(m: _Net) -> None:
        m.schedule.boost = 2.0  # type: ignore[attr-defined]

    reasons = _train(lambda m: getattr(m.schedule, "boost", 1.0), {2: boost}, caplog)
    assert reasons[1] == f"capturing a graph: schedule.boost changed from <unset> to 2.0 {_HELD}"


def test_reading_the_whole_object_watches_all_of_it(caplog: pytest.LogCaptureFixture) -> None:
    """``vars(obj)`` hands out every value at once: each of them is watched, the epoch too."""

    def epoch(m: _Net) -> None:
        m.schedule.epoch += 1

    reasons = _train(lambda m: float(len(vars(m.schedule))) + m.schedule.low, {3: epoch}, caplog)
    assert reasons[1] == f"capturing a graph: schedule.epoch changed from 0 to 1 {_HELD}"


def test_a_replaced_object_is_watched_whole_until_captured(caplog: pytest.LogCaptureFixture) -> None:
    def replace(m: _Net) -> None:
        m.schedule = _Schedule()
        m.schedule.low = 0.25

    def epoch(m: _Net) -> None:
        m.schedule.epoch += 1

    reasons = _train(lambda m: m.schedule.scale, {2: replace, 4: epoch}, caplog)
    assert len(reasons) == 2 and "schedule" in reasons[1]


def test_reads_in_an_inherited_method_count(caplog: pytest.LogCaptureFixture) -> None:
    def high(m: _Net) -> None:
        m.schedule.high = 5.0

    reasons = _train(lambda m: m.schedule.peak(), {3: high}, caplog)
    assert reasons == [
        "capturing a graph: first call",
        f"capturing a graph: schedule.high changed from 2.0 to 5.0 {_HELD}",
    ]


def test_lookups_are_recorded_only_while_capturing() -> None:
    schedule, other = _Schedule(), _Schedule()
    reads = AttributeReads()
    assert reads.names(schedule) is None
    with reads.recording([schedule]):
        assert schedule.scale == 0.5
        assert other.high == 2.0  # not tracked
    assert reads.names(schedule) == ("_scale", "low", "scale", "warm")
    assert reads.names(other) is None
    assert "__getattribute__" not in vars(_Schedule)  # the class is as it was
    with reads.recording([schedule]):
        assert schedule.high == 2.0
    assert reads.names(schedule) == ("_scale", "high", "low", "scale", "warm")
    version = reads.version
    with reads.recording([other]):  # the model no longer holds ``schedule``
        pass
    assert reads.names(schedule) is None and reads.names(other) == () and reads.version > version


def test_an_object_with_its_own_lookup_is_watched_whole() -> None:
    class Mapped:
        def __init__(self) -> None:
            self.n_embd = 4

        def __getattr__(self, name: str) -> Any:
            return object.__getattribute__(self, {"hidden_size": "n_embd"}[name])

    mapped = Mapped()
    reads = AttributeReads()
    with reads.recording([mapped]):
        assert mapped.hidden_size == 4  # type: ignore[attr-defined]
    assert reads.names(mapped) is None


def _low(m: _Net) -> float:
    return m.schedule.low


def test_copies_and_pickles_of_the_wrapper_start_with_no_record() -> None:
    torch.manual_seed(0)
    wrapped = ORTModule(_Net(_low))
    wrapped(torch.randn(3, 4)).backward()
    assert wrapped._ortrain_reads.names(wrapped.module.schedule) == ("low",)
    for copied in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert copied._ortrain_reads.names(copied.module.schedule) is None
        copied(torch.randn(3, 4)).backward()
        assert copied._ortrain_reads.names(copied.module.schedule) == ("low",)
