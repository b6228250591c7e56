"""A model trained under ORTModule exports for inference as the model itself would: torch.export
and torch.onnx.export trace the model's own forward, torch.jit.script scripts it, and
torch.jit.trace, which cannot see the parameters through the wrapper, says what to trace."""

from __future__ import annotations

import io

import onnxruntime as ort
import pytest
import torch
from torch import nn

from ortrain import ORTModule


@pytest.fixture
def trained() -> tuple[ORTModule, torch.Tensor]:
    torch.manual_seed(0)
    wrapped = ORTModule(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2)))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        wrapped(torch.randn(16, 4)).square().mean().backward()
        opt.step()
    return wrapped.eval(), torch.randn(5, 4)


def _onnx_outputs(model_bytes: bytes, x: torch.Tensor) -> torch.Tensor:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def test_torch_export_traces_the_models_own_forward(trained) -> None:
    """It failed on the wrapper's forward ("'BoundForward' object has no attribute '__code__'")."""
    wrapped, x = trained
    program = torch.export.export(wrapped, (x,))
    torch.testing.assert_close(program.module()(x), wrapped.module(x))
    assert not any(n.target == torch.ops.higher_order.autograd_function_apply for n in program.graph.nodes)
    exported = {name: value for name, value in program.state_dict.items()}
    for name, parameter in wrapped.named_parameters():
        torch.testing.assert_close(exported[name], parameter.detach())


@pytest.mark.parametrize("dynamo", [True, False])
def test_onnx_export_gives_the_trained_model(trained, dynamo: bool) -> None:
    wrapped, x = trained
    buffer = io.BytesIO()
    if dynamo:
        torch.onnx.export(wrapped, (x,), dynamo=True).save(buffer)
    else:
        with pytest.warns(DeprecationWarning):
            torch.onnx.export(wrapped, (x,), buffer, dynamo=False)
    torch.testing.assert_close(_onnx_outputs(buffer.getvalue(), x), wrapped.module(x).detach())


def test_jit_script_scripts_the_model(trained) -> None:
    wrapped, x = trained
    scripted = torch.jit.script(wrapped)
    torch.testing.assert_close(scripted(x), wrapped.module(x))
    assert {n for n, _ in scripted.named_parameters()} == {n for n, _ in wrapped.named_parameters()}


def test_jit_trace_names_what_to_trace(trained) -> None:
    wrapped, x = trained
    with pytest.raises(RuntimeError, match=r"trace the model it wraps, torch\.jit\.trace\(wrapped\.module"):
        torch.jit.trace(wrapped, (x,))
    traced = torch.jit.trace(wrapped.module, (x,))
    torch.testing.assert_close(traced(x), wrapped.module(x))
