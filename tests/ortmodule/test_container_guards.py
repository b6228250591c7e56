"""Values kept in containers and arrays on a model, changed in place between steps (wave 32).

Until wave 32 each case below kept training on the values the graph was captured with, silently:
a NumPy array or a list of more than 64 numbers the forward makes a tensor of, and the schedules,
dataclasses and tables kept in a module's list or dict (only the container's identity was watched).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import enum
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _parity import calls_agree, capture_reasons_across
from torch import nn

from ortrain import ORTModule
from ortrain.errors import ORTModuleTorchModelException


class _Schedule:
    def __init__(self) -> None:
        self.beta = 1.0


@dataclasses.dataclass
class _Weights:
    beta: float = 1.0


class _Helper:
    def __init__(self) -> None:
        self.offsets = np.zeros(4, dtype=np.float32)


class _ValuesNet(nn.Module):
    """Values a forward makes tensors of: a NumPy array and a list longer than 64 on the module,
    an array on an object it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.anchors = np.ones(4, dtype=np.float32)
        self.class_weights = [1.0] * 100
        self.helper = _Helper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * torch.from_numpy(self.anchors) + torch.from_numpy(self.helper.offsets)
        return (h * torch.tensor(self.class_weights[:4])).square().mean()


def _set_anchor(m: _ValuesNet) -> None:
    m.anchors[:2] = 3.0


def _set_weight(m: _ValuesNet) -> None:
    m.class_weights[1] = 5.0


def _set_offset(m: _ValuesNet) -> None:
    m.helper.offsets[0] = 0.5


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_set_anchor, "(the model).anchors changed in place (an array (<f4, shape [4]))"),
        (_set_weight, "(the model).class_weights changed from [1.0, 1.0, 1.0"),
        (_set_offset, "helper.offsets changed from an array (<f4, shape [4]) to an array (<f4, shape [4])"),
    ],
    ids=["module's array", "module's long list", "held object's array"],
)
def test_an_array_or_long_list_changed_in_place(
    change: Callable[[_ValuesNet], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    _check(_ValuesNet, change, reason, caplog)


class _ContainersNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.nested = {"a": {"scale": 1.0}}
        self.schedules = [_Schedule(), _Schedule()]
        self.by_name = {"kl": _Schedule()}
        self.weights = [_Weights(), _Weights()]
        self.defaults: collections.defaultdict[str, float] = collections.defaultdict(lambda: 1.0)
        self.defaults["w"] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.nested["a"]["scale"] * self.schedules[1].beta * self.by_name["kl"].beta
        scale = scale * self.weights[0].beta * self.defaults["w"]
        return (self.fc(x) * scale).square().mean()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m.nested["a"].__setitem__("scale", 2.0), "nested.a.scale changed from 1.0 to 2.0 (a dict"),
        (lambda m: setattr(m.schedules[1], "beta", 2.0), "schedules.1.beta changed from 1.0 to 2.0 (a list"),
        (lambda m: setattr(m.by_name["kl"], "beta", 2.0), "by_name.kl.beta changed from 1.0 to 2.0 (a dict"),
        (lambda m: setattr(m.weights[0], "beta", 2.0), "weights.0.beta changed from 1.0 to 2.0 (a list"),
        (lambda m: m.defaults.__setitem__("w", 2.0), "defaults.w changed from 1.0 to 2.0 (a defaultdict"),
    ],
    ids=["dict in a dict", "object in a list", "object in a dict", "dataclass in a list", "defaultdict"],
)
def test_a_value_inside_a_container_changed_in_place(
    change: Callable[[Any], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    _check(_ContainersNet, change, reason, caplog)


def _check(
    build: Callable[[], nn.Module],
    change: Callable[[Any], None],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Eager and ORTModule agree before and after ``change``, which captures once more for ``reason``."""
    torch.manual_seed(0)
    reasons = capture_reasons_across(build(), lambda a, b: (change(a), change(b)), caplog)
    assert len(reasons) == 2 and reasons[1].startswith(f"capturing a graph: {reason}")


class _Counted:
    def __init__(self) -> None:
        self.calls = 0


class _CountingNet(nn.Module):
    """A forward that counts its calls on an object kept in a list or a dict of dicts."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.where = where
        self.counters = [_Counted()]
        self.nested = {"a": {"counter": _Counted()}}

    def counter(self) -> _Counted:
        return self.counters[0] if self.where == "list" else self.nested["a"]["counter"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counter = self.counter()
        counter.calls += 1
        return (self.fc(x) * counter.calls).square().mean()


@pytest.mark.parametrize("where", ["list", "dict of dicts"])
def test_a_forward_that_counts_on_an_object_in_a_container(where: str) -> None:
    """Until wave 32 the capture's trace counted (three times) and the graph never did again."""
    calls_agree(_CountingNet(where), lambda m: m.counter().calls)


class _NestedCountNet(nn.Module):
    """A forward that counts its calls in a table inside a table."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.where = where
        self.nested = {"a": {"calls": 0}}
        self.rows = [[0]]
        self.pair = ({"calls": 0},)

    def count(self) -> int:
        if self.where == "dict in a dict":
            self.nested["a"]["calls"] += 1
            return self.nested["a"]["calls"]
        if self.where == "list in a list":
            self.rows[0][0] += 1
            return self.rows[0][0]
        self.pair[0]["calls"] += 1
        return self.pair[0]["calls"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.count()).square().mean()


@pytest.mark.parametrize("where", ["dict in a dict", "list in a list", "dict in a tuple"])
def test_a_forward_that_counts_in_a_nested_table(where: str) -> None:
    calls_agree(_NestedCountNet(where), lambda m: (m.nested, m.rows, m.pair))


class _Slotted:
    __slots__ = ("beta", "calls")

    def __init__(self) -> None:
        self.beta = 1.0
        self.calls = 0


class _SlottedNet(nn.Module):
    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.schedule = _Slotted()
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count:
            self.schedule.calls += 1
        return (self.fc(x) * self.schedule.beta * (self.schedule.calls or 1)).square().mean()


def test_an_object_with_slots_is_read_by_its_values(caplog: pytest.LogCaptureFixture) -> None:
    """Without a ``__dict__`` it was watched by identity alone until wave 32."""
    _check(
        _SlottedNet,
        lambda m: setattr(m.schedule, "beta", 2.0),
        "schedule.beta changed from 1.0 to 2.0 (an object held by '(the model)')",
        caplog,
    )


def test_a_forward_that_counts_on_an_object_with_slots() -> None:
    calls_agree(_SlottedNet(count=True), lambda m: m.schedule.calls)


class _RecentNet(nn.Module):
    """Scales by the mean of the last losses, kept in a bounded deque the loop appends to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.recent: collections.deque[float] = collections.deque([1.0], maxlen=3)
        self.code = bytearray(b"a")
        self.weights = array.array("f", [1.0, 2.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * (sum(self.recent) / len(self.recent)) * self.weights[0]
        return (torch.tanh(h) if self.code == b"a" else h).square().mean()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda m: m.recent.append(3.0),
            "(the model).recent changed from ('deque', 3, (1.0,)) to ('deque', 3, (1.0, 3.0))",
        ),
        (lambda m: m.code.__setitem__(0, ord("b")), "(the model).code changed from ('bytearray', '', b'a')"),
        (lambda m: m.weights.__setitem__(0, 3.0), "(the model).weights changed from ('array', 'f'"),
    ],
    ids=["deque", "bytearray", "array.array"],
)
def test_a_deque_bytearray_or_array_changed_in_place(
    change: Callable[[Any], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Watched by identity until wave 36: the graph kept the captured values, silently."""
    _check(_RecentNet, change, reason, caplog)


class _AppendingNet(nn.Module):
    """A forward that appends to a deque, bounded or not, and reads its length."""

    def __init__(self, maxlen: int | None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: collections.deque[int] = collections.deque(maxlen=maxlen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return (self.fc(x) * len(self.seen)).square().mean()


def test_a_forward_that_appends_to_a_deque() -> None:
    """Until wave 36 the capture's trace appended and the graph never did."""
    calls_agree(_AppendingNet(None), lambda m: list(m.seen))


def test_a_forward_that_appends_to_a_bounded_deque_trains_in_pytorch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TorchDynamo's graph breaks, where a model that changes itself at every call trains, do not
    drop the oldest entry of a full bounded deque (torch 2.13: ``len`` read 3 for ``maxlen=2``):
    such a model falls back to PyTorch, with the reason, or raises it under FALLBACK_DISABLE."""
    with pytest.raises(ORTModuleTorchModelException, match="appending to a deque with a maxlen"):
        calls_agree(_AppendingNet(2), lambda m: list(m.seen))
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        calls_agree(_AppendingNet(2), lambda m: list(m.seen))
    assert "appending to a deque with a maxlen" in caplog.text


class _Task(enum.Enum):
    CLS = 1
    REG = 2


_TASK_WEIGHTS = {_Task.CLS: 1.0}  # module level, read by the forward


class _KeyedNet(nn.Module):
    """Tables keyed by enum members, tuples and ints, and sets of them (wave 52's review: the first
    two were watched by identity only, and keys were compared as ``str(key)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.by_task = {_Task.CLS: 1.0, _Task.REG: 1.0}
        self.by_place = {("fc", 0): 1.0}
        self.by_number: dict[int | str, float] = {1: 2.0}
        self.active = {_Task.CLS}
        self.pairs = {(0, 1)}
        self.by_other = {np.int64(3): 1.0, frozenset({1, 2}): 1.0, b"k": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.by_task[_Task.CLS] * self.by_place[("fc", 0)] * self.by_number.get(1, 0.5)
        scale = scale * _TASK_WEIGHTS[_Task.CLS] * (3.0 if _Task.REG in self.active else 1.0)
        scale = scale * (0.5 if (1, 1) in self.pairs else 1.0)
        scale = scale * self.by_other[np.int64(3)] * self.by_other[frozenset({1, 2})] * self.by_other[b"k"]
        return (self.fc(x) * scale).square().mean()


def _renumber(m: _KeyedNet) -> None:
    del m.by_number[1]
    m.by_number["1"] = 2.0  # str(key) is the same


def _set_global(_: _KeyedNet) -> None:
    _TASK_WEIGHTS[_Task.CLS] = 3.0


_HELD = "held by '(the model)')"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m.by_task.__setitem__(_Task.CLS, 3.0), "by_task[_Task.CLS] changed from 1.0 to 3.0"),
        (lambda m: m.by_place.__setitem__(("fc", 0), 3.0), "by_place[('fc', 0)] changed from 1.0 to 3.0"),
        (_renumber, f"by_number.1 changed from '<unset>' to 2.0 (a dict {_HELD}"),  # the str key "1"
        (_set_global, "global test_container_guards._TASK_WEIGHTS[_Task.CLS] changed from 1.0 to 3.0"),
        (lambda m: m.active.add(_Task.REG), f"active.members changed (a set {_HELD}"),
        (lambda m: m.pairs.add((1, 1)), f"pairs.members changed (a set {_HELD}"),
        (lambda m: m.by_other.__setitem__(np.int64(3), 3.0), "by_other[np.int64(3)] changed from 1.0 to 3.0"),
        (lambda m: m.by_other.__setitem__(frozenset({2, 1}), 3.0), "by_other[frozenset({1, 2})] changed"),
        (lambda m: m.by_other.__setitem__(b"k", 3.0), "by_other[b'k'] changed from 1.0 to 3.0"),
    ],
    ids=[
        "enum key",
        "tuple key",
        "int key made str",
        "global enum key",
        "enum members",
        "tuple members",
        "numpy key",
        "frozenset key",
        "bytes key",
    ],
)
def test_a_table_keyed_by_enum_members_or_tuples_changed_in_place(
    change: Callable[[Any], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        _check(_KeyedNet, change, reason, caplog)
    finally:
        _TASK_WEIGHTS[_Task.CLS] = 1.0


class _RaisingEquality:
    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("this key cannot be compared")


class _OddlyKeyed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.key = _RaisingEquality()
        self.scales = {self.key: 2.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scales[self.key]


def test_an_error_while_putting_the_model_back_after_a_capture_is_the_one_raised() -> None:
    """It was hidden behind ``UnboundLocalError: cannot access local variable 'changes'``."""
    with pytest.raises(RuntimeError, match="this key cannot be compared"):
        ORTModule(_OddlyKeyed())(torch.randn(2, 4))
