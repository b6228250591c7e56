"""Python numbers in tensor operands (``1.0 - x``, ``1.0 // x``) become 0-dimensional tensors of
the dtype PyTorch gives them, so that the exporter translates the node."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain import ORTModule
from ortrain.export.number_operands import tensors_for_number_operands


def _numbers_first(x: torch.Tensor, ids: torch.Tensor, half: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return 1.0 - x, 1.0 // x, 3 - ids, torch.sub(0.5, half), torch.where(ids > 1, 2.5, x)


def test_numbers_become_tensors_of_the_dtype_pytorch_gives_them() -> None:
    inputs = (torch.randn(4) + 2, torch.arange(4, dtype=torch.int32), torch.randn(3, dtype=torch.float16))
    gm = make_fx(_numbers_first, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*inputs)
    assert tensors_for_number_operands(gm) == 4  # where(ids > 1, 2.5, x) comes with its own
    made = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scalar_tensor.default]
    assert [(n.args[0], n.kwargs["dtype"]) for n in made] == [
        (1.0, torch.float32),
        (1.0, torch.float32),
        (3, torch.int32),
        (0.5, torch.float16),
    ] + [(2.5, torch.float32)] * (len(made) - 4)
    for node in gm.graph.nodes:
        if node.target in (torch.ops.aten.sub.Tensor, torch.ops.aten.div.Tensor_mode):
            assert all(isinstance(a, torch.fx.Node) for a in node.args)
    for got, expected in zip(gm(*inputs), _numbers_first(*inputs), strict=True):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)


class _Gates(nn.Module):
    """ProphetNet's ``1.0 - mask`` and IBert's ``1.0 // x``: each sent its whole region to PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.linear(x) + (1.0 - mask) * -1e4  # an integer mask, made float by promotion
        gate = 1.0 - torch.sigmoid(h)
        scale = 1.0 // (h.detach().abs().amax(0) + 0.5)
        return (h * gate * (scale + 1)).square().mean()


def test_a_model_with_numbers_first_trains_in_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # nothing may go to PyTorch
    torch.manual_seed(0)
    eager = _Gates()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        mask = torch.ones(8, 6, dtype=torch.long)
        mask[:, step:] = 0
        losses = []
        for module in (eager, wrapped):
            module.zero_grad()
            loss = module(x, mask)
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
        for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
            # The -1e4 mask makes the loss about 1e8 and the gradients up to about 3e3: eager's own
            # float32 gradients are 2e-4 off the float64 ones, so the two may differ by that much
            # where the kernels sum in another order (they did on an AMD EPYC).
            torch.testing.assert_close(p.grad, q.grad, rtol=1.3e-6, atol=1e-6 * q.grad.abs().max().item())
    (entry,) = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    for runner in (entry.capture.forward.runner, entry.capture.backward.runner):
        assert "torch" not in runner.plan.nodes_by_executor()


class _ByItsLength(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x * self.w * (i % n).float()[:, None] + (i // n).float()[:, None]


def test_an_integer_remainder_by_a_size_that_changes_runs_in_onnx_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``i % x.shape[0]`` once the length is symbolic: torchlib's ``remainder.Scalar`` made a
    constant of the size and the export failed (wave 41: that region ran in PyTorch, or raised under
    ``FALLBACK_DISABLE``); as ``remainder.Tensor`` of a 0-d tensor it exports, with Python's signs."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    eager = _ByItsLength()
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (4, 5, 7):
        x, i = torch.randn(length, 4), torch.arange(length) * 3 - 11
        expected, got = eager(x, i), wrapped(x, i)
        assert torch.equal(got, expected)


class _Dequantized(nn.Module):
    """int8 codes dequantized as ``q / 128``, a uint8 shade as ``u / -2``: numbers the codes' dtype
    cannot hold, where true division computes in float."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return ((q / 128) * self.scale).sum() + (u / -2 * self.scale).sum() + (300 / q.clamp(min=1)).sum()


def test_an_int_the_tensors_dtype_cannot_hold_keeps_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 48's review: 128 became an int8 -128 (every dequantized sign flipped), -2 a uint8 254."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    eager = _Dequantized()
    model = copy.deepcopy(eager)
    q = torch.tensor([[-100, 50, 127], [3, -7, 64]], dtype=torch.int8)
    u = torch.tensor([2, 4, 200], dtype=torch.uint8)
    got, expected = ORTModule(model)(q, u), eager(q, u)
    torch.testing.assert_close(got, expected)
    got.backward()
    expected.backward()
    torch.testing.assert_close(model.scale.grad, eager.scale.grad)
