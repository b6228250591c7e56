"""Which objects a model holds count as its state (ortrain/capture/held_objects.py)."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ortrain.capture.held_objects import held_objects, is_held_object


class _State:
    def __init__(self) -> None:
        self.step = 0


class _Trainer:
    def __init__(self) -> None:
        self.state = _State()
        self.again = self  # a cycle: walked once
        self.deeper = _Trainer.__new__(_Trainer)
        self.deeper.__dict__["state"] = _State()  # three levels down: not walked


@dataclasses.dataclass
class _Config:
    scale: float = 1.0


def test_only_the_users_plain_objects_are_held_objects() -> None:
    assert is_held_object(_State())
    assert not is_held_object(_Config())  # read as a config
    assert not is_held_object(nn.Linear(1, 1))  # a module of the model
    assert not is_held_object(logging.getLogger("ortrain"))  # the standard library's
    handle = nn.Linear(1, 1).register_forward_hook(lambda *a: None)
    assert not is_held_object(handle)  # PyTorch's
    assert not is_held_object(torch.ones(1)) and not is_held_object(_State)


def test_held_objects_are_found_two_levels_down_each_once() -> None:
    trainer = _Trainer()
    found = list(held_objects([("trainer", trainer), ("count", 3), ("alias", trainer)]))
    assert [(path, id(obj)) for path, obj in found] == [
        ("trainer", id(trainer)),
        ("trainer.state", id(trainer.state)),
        ("trainer.deeper", id(trainer.deeper)),
    ]
