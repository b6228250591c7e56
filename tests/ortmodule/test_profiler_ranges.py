"""``torch.profiler.record_function`` ranges inside a forward leave no operators in the graphs
(ortrain/capture/profiler_ranges.py): the model is captured whole, as it would be without them."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn

from ortrain import ORTModule


class _Ranged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            with torch.profiler.record_function(f"layer{i}"):
                x = torch.relu(layer(x))
        return x.pow(2).mean()


def test_a_forward_with_profiler_ranges_is_captured_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 47's review: the ranges' profiler operators have no ONNX translation, so each split the
    graph (1.5x slower) and FALLBACK_DISABLE (set by this folder's conftest) refused the model."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    batches = [torch.randn(4, 8) for _ in range(3)]
    losses, expected, eager, wrapped = train_side_by_side(_Ranged(), batches, lambda m, x: m(x))
    torch.testing.assert_close(losses, expected)
    assert_same_state(wrapped.module, eager)
    (entry,) = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    for graph in (entry.capture.forward.graph, entry.capture.backward.graph):
        assert not [n for n in graph.graph.nodes if "profiler" in str(n.target)]
    with torch.profiler.record_function("outside"):  # the class is itself again after the capture
        assert torch.autograd.profiler.record_function.__enter__.__module__ == "torch.autograd.profiler"


_block_range = torch.profiler.record_function("block")


class _DecoratedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @_block_range
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum()


def test_a_range_used_as_a_decorator_still_records_after_a_capture() -> None:
    """The review of wave 47's diff: the capture's stand-in set the decorator instance's
    ``run_callbacks_on_exit`` off, and its eager ranges afterwards never closed."""
    model = _DecoratedForward()
    ORTModule(model)(torch.randn(2, 4)).backward()
    assert _block_range.run_callbacks_on_exit
    with torch.profiler.profile() as profile:
        model(torch.randn(2, 4))
    assert [e for e in profile.events() if e.name == "block"]
