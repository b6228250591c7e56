"""One training step of a module under ORTModule (ONNX Runtime placement, no fallback) against
eager PyTorch, for pass tests: the loss and every gradient compared, the optimized graphs returned."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch

from ortrain import ORTModule
from ortrain.ortmodule import DebugOptions


def one_step_against_eager(
    build: Callable[[], torch.nn.Module],
    *inputs: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> tuple[torch.nn.Module, dict[str, onnx.ModelProto]]:
    """The eager module after its step, and the graphs ONNX Runtime ran (``forward``,
    ``backward``), after the passes."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # ONNX Runtime's placement, not the tuner's
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    torch.manual_seed(0)
    eager = build()
    wrapped = ORTModule(build(), DebugOptions(save_onnx=True, onnx_prefix="parity"))
    wrapped.module.load_state_dict(eager.state_dict())
    expected_loss, loss = eager(*inputs), wrapped(*inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=rtol, atol=atol)
    expected_loss.backward()
    loss.backward()
    for (name, expected), got in zip(eager.named_parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=rtol, atol=atol, msg=name)
    graphs = {g: onnx.load(tmp_path / f"parity_{g}_optimized_training.onnx") for g in ("forward", "backward")}
    return eager, graphs
