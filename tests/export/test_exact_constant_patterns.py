"""A small constant added or multiplied is not taken for 0 or 1 by the rewrite rules."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten


def _near_identities(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (
        aten.add.Tensor(x, 1e-8),
        aten.add.Tensor(x, 1e-12),
        aten.sub.Tensor(x, 1e-9),
        aten.mul.Tensor(x, 1.000001),
        aten.div.Tensor(x, 1.000001),
        aten.add.Tensor(x, 0.0),  # not a no-op either: -0.0 + 0.0 is +0.0 (kept since wave 41)
    )


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "torch.onnx.export"])
def test_near_identities_survive_the_export(direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    from ortrain.export import fx_to_onnx

    monkeypatch.setattr(fx_to_onnx, "DIRECT_TRANSLATION", direct)
    x = torch.tensor([0.0, -0.0, 1e-9, 1.0, 3.0e5])
    exported = fx_to_onnx.export_graph(make_fx(_near_identities, tracing_mode="fake")(x), opset_version=18)
    # before wave 35 the first five outputs came back as x itself, before wave 41 the sixth
    ops = [n.op_type for n in exported.model.graph.node]
    assert ops == ["Add", "Add", "Sub", "Mul", "Div", "Add"]
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    results = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for got, expected in zip(results, _near_identities(x), strict=True):
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=0)
        assert torch.equal(torch.from_numpy(got).signbit(), expected.signbit())


class _LogLikelihood(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        probs = torch.relu(self.linear(x))
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-12)
        return -(target * torch.log(probs + 1e-8)).sum(-1).mean()


def test_an_epsilon_keeps_the_loss_finite_in_onnx_runtime() -> None:
    """Wave 35: ``log(p + 1e-8)`` of a zero probability was ``-inf`` in ONNX Runtime (the rule
    removing ``x + 0`` took 1e-8 for 0), so the loss and every gradient were NaN."""
    from ortrain import ORTModule

    torch.manual_seed(0)
    model = _LogLikelihood()
    with torch.no_grad():
        model.linear.bias.copy_(torch.tensor([-10.0, 0.0, 0.0]))  # the first probability is 0
    wrapped = ORTModule(copy.deepcopy(model))
    x, target = torch.rand(5, 4), torch.full((5, 3), 1 / 3)
    expected, got = model(x, target), wrapped(x, target)
    assert torch.isfinite(expected)
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    torch.testing.assert_close(wrapped.module.linear.weight.grad, model.linear.weight.grad)
