"""Which tensor classes override PyTorch's operator protocols."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ortrain.capture.tensor_subclasses import overridden_protocols


class _Named(torch.Tensor):
    pass


class _Functional(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


class _Dispatching(torch.Tensor):
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_plain_classes_and_parameters_override_nothing_the_others_are_named() -> None:
    for kind in (torch.Tensor, _Named, nn.Parameter, nn.Buffer):
        assert overridden_protocols(kind) == [], kind
    assert overridden_protocols(_Functional) == ["__torch_function__"]
    assert overridden_protocols(_Dispatching) == ["__torch_dispatch__"]


def test_only_plain_subclasses_keep_their_class_through_operators() -> None:
    from ortrain.capture.tensor_subclasses import keeps_its_class

    assert keeps_its_class(_Named)
    for kind in (torch.Tensor, nn.Parameter, nn.Buffer, _Functional, _Dispatching):
        assert not keeps_its_class(kind), kind
    assert type(torch.ones(2).as_subclass(_Named) * 2) is _Named  # what the rule follows
