"""A module the forward calls that the model does not hold (kept at module level, or in a plain
list to stay out of ``parameters()``) has its plain attributes and ``training`` flag watched like
a submodule's: until wave 52 the graph kept the values of its first capture, silently."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.t


_DROP = nn.Dropout(0.0)  # module level, shared: the loop anneals its p


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.aux = [_Temperature()]  # kept out of parameters() and state_dict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DROP(self.aux[0](self.fc(x))).square().mean()


def test_changes_to_modules_the_model_does_not_hold_are_seen(
    calls_like_eager: Callable[[nn.Module, nn.Module, Sequence[torch.Tensor]], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    eager = _Net()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    x = torch.randn(3, 4)
    # p=1.0 drops everything in train mode: each setting has one answer, random draws aside.
    settings = [(1.0, 0.0, True), (0.25, 0.0, True), (0.25, 1.0, True), (0.25, 1.0, False), (1.0, 0.0, True)]
    try:
        with caplog.at_level(logging.INFO, logger="ortrain"):
            for t, p, train in settings:
                eager.aux[0].t = model.aux[0].t = t
                _DROP.p = p
                _DROP.train(train)
                calls_like_eager(eager, wrapped, [x])
    finally:
        _DROP.p = 0.0
        _DROP.train()
    assert wrapped._ortrain_graph_breaks is None
    assert len(wrapped._ortrain_graphs) == 4  # the last setting is the first's: its graph again
    outside = "(a module the forward calls that the model does not hold)"
    assert f"capturing a graph: _Temperature.t changed from 1.0 to 0.25 {outside}" in caplog.text
    assert f"capturing a graph: Dropout.p changed from 0.0 to 1.0 {outside}" in caplog.text
    assert f"capturing a graph: submodule 'Dropout' was switched to eval mode {outside}" in caplog.text
