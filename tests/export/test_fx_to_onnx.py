"""export_graph on its own: what becomes an ONNX output, and what the executor rebuilds."""

from __future__ import annotations

import onnx
import torch
from torch import nn

from ortrain.capture.aot_capture import capture
from ortrain.export.fx_to_onnx import export_graph
from ortrain.runtime.executors.ort import OrtSessionRunner


class _SavesInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.linear(x))
        return h.sum(), h


def test_only_distinct_computed_tensors_become_onnx_outputs() -> None:
    x = torch.randn(3, 4)
    captured = capture(_SavesInputs(), [x], training=True)
    exported = export_graph(captured.forward.graph, opset_version=18)
    onnx.checker.check_model(exported.model)
    kinds = [s.kind for s in exported.outputs]
    assert "input" in kinds  # x is saved for backward: passed through, never copied
    n_onnx = sum(k == "onnx" for k in kinds)
    assert len(exported.model.graph.output) == n_onnx
    backward = export_graph(captured.backward.graph, opset_version=18)
    assert [s.kind for s in backward.outputs][-1] == "none"  # no gradient for the input x


def test_executor_reproduces_the_fx_graph() -> None:
    x = torch.randn(3, 4)
    module = _SavesInputs()
    captured = capture(module, [x], training=True)
    state = dict(module.named_parameters())
    args = [state[name] for name in captured.state_names] + [x]
    want = captured.forward.graph(*args)
    got = OrtSessionRunner(
        export_graph(captured.forward.graph, opset_version=18), device=torch.device("cpu")
    )(args)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert got[-1] is x or any(g is x for g in got)


def test_dynamic_sizes_export_once_and_run_every_size() -> None:
    module = _SavesInputs()
    captured = capture(module, [torch.randn(3, 4)], training=True, dynamic_dims={0: (0,)})
    executor = OrtSessionRunner(
        export_graph(captured.forward.graph, opset_version=18), device=torch.device("cpu")
    )
    state = dict(module.named_parameters())
    for rows in (2, 5, 11):
        args = [state[name] for name in captured.state_names] + [torch.randn(rows, 4)]
        for a, b in zip(executor(args), captured.forward.graph(*args), strict=True):
            if isinstance(b, torch.Tensor):
                torch.testing.assert_close(a, b)
            else:
                assert a == b  # a size, computed from the input's shape
