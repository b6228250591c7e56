"""PyTorch's whole-graph placement gets its inputs in the strides they were captured with."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.runtime.recorded_input_layouts import RecordedInputLayouts


def _graph_of(*examples: torch.Tensor) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    outputs = []
    for i, example in enumerate(examples):
        node = graph.placeholder(f"x{i}")
        node.meta["val"] = example
        outputs.append(node)
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(nn.Module(), graph)


def test_inputs_come_back_in_the_recorded_layout_and_are_copied_only_then() -> None:
    recorded_transposed = torch.empty(5, 4).t()
    layouts = RecordedInputLayouts(_graph_of(torch.empty(4, 5), recorded_transposed, torch.empty(8)[::2]))
    contiguous, transposed, strided = torch.randn(4, 5), torch.randn(5, 4).t(), torch.randn(12)[::3]
    same = [contiguous, transposed, strided]
    assert layouts.restore(same) is same  # every layout as recorded (gaps: passed as they come)
    swapped = layouts.restore([transposed, contiguous, strided])
    assert swapped[0].is_contiguous() and torch.equal(swapped[0], transposed)
    assert swapped[1].stride() == recorded_transposed.stride() and torch.equal(swapped[1], contiguous)
    assert swapped[2] is strided


class _Flatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Traced on a contiguous batch, the reshape is recorded as a view.
        return self.linear(x.reshape(x.shape[0], -1)).square().mean()


def test_a_transposed_batch_after_a_contiguous_one_runs_in_every_placement(
    monkeypatch: pytest.MonkeyPatch, calls_like_eager: Callable[..., None]
) -> None:
    """Automatic op tuning runs PyTorch's placement first: its view of a transposed batch failed
    ("view size is not compatible with input tensor's size and stride") and the model fell back
    to PyTorch for good."""
    monkeypatch.delenv("ORTMODULE_ENABLE_TUNING", raising=False)
    # The default policy: FALLBACK_DISABLE would build ONNX Runtime's placement first.
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    torch.manual_seed(0)
    eager = _Flatten()
    batches = [
        torch.randn(6, 4, 8) if step % 2 == 0 else torch.randn(6, 8, 4).transpose(1, 2) for step in range(8)
    ]
    calls_like_eager(eager, ORTModule(copy.deepcopy(eager)), batches)
