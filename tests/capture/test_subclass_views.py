"""``as_subclass`` while capturing: an alias of the tensor, its class remembered."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ortrain.capture.function_overrides import dynamo_graph_overrides
from ortrain.capture.subclass_views import made_as, subclasses_as_plain_tensors
from ortrain.errors import ORTModuleTorchModelException


class _Tagged(torch.Tensor):
    pass


class _Logged(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_plain_class_gives_a_marked_alias_and_operators_pass_the_mark_on() -> None:
    x = torch.randn(3)
    with subclasses_as_plain_tensors(), dynamo_graph_overrides():
        tagged = x.as_subclass(_Tagged)
        assert type(tagged) is torch.Tensor and tagged is not x
        assert made_as(tagged) is _Tagged and made_as(x) is None
        doubled = tagged * 2  # PyTorch's default __torch_function__ keeps the class
        assert made_as(doubled) is _Tagged
        plain = tagged.as_subclass(torch.Tensor)
        assert made_as(plain) is None and made_as(plain + 1) is None
    assert made_as(tagged) is None  # outside: nothing is remembered
    assert type(x.as_subclass(_Tagged)) is _Tagged


def test_a_class_with_its_own_operators_is_refused_by_name() -> None:
    with subclasses_as_plain_tensors(), pytest.raises(ORTModuleTorchModelException, match="_Logged"):
        torch.randn(2).as_subclass(_Logged)


def test_pytorchs_own_classes_get_pytorchs_as_subclass() -> None:
    with subclasses_as_plain_tensors():
        made = torch.randn(2).as_subclass(torch.nn.Parameter)
    assert type(made) is torch.nn.Parameter and made_as(made) is None


def test_other_threads_keep_pytorchs_as_subclass() -> None:
    seen: list[type] = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        seen.append(type(torch.randn(2).as_subclass(_Tagged)))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with subclasses_as_plain_tensors():
        inside.set()
        done.wait()
    thread.join()
    assert seen == [_Tagged]
