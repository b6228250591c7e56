"""A float64 model's numbers computed from a size the graph leaves open (``var``'s ``2 / (n - 1)``,
``mse_loss``'s ``2 / numel``, a scale ``1 / n`` saved for the backward) are computed in float64:
eager's gradients to the last bits, from the first dynamic capture on."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ortrain import ORTModule

FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "h + (n - 0.5) / 3.3": lambda h: (h + (h.shape[0] - 0.5) / 3.3).pow(2).sum(),
    "var(0)": lambda h: h.var(0).sum(),
    "mse_loss": lambda h: nn.functional.mse_loss(h, h.flip(0).detach()),
    "h * (1 / n)": lambda h: (h * (1.0 / h.shape[0])).pow(2).sum(),
    "h * n ** 0.5": lambda h: (h * h.shape[0] ** 0.5).pow(2).sum(),
    "h * n ** -1.5 + 1": lambda h: (h * h.shape[0] ** -1.5 + 1).pow(2).sum(),
    "batch_norm": lambda h: nn.functional.batch_norm(h, None, None, training=True).pow(3).sum(),
}


class _Model(nn.Module):
    def __init__(self, form: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, bias=False, dtype=torch.float64)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.form(self.linear(x))


@pytest.mark.parametrize("form", list(FORMS), ids=str)
def test_numbers_from_open_sizes_are_float64_in_a_float64_model(monkeypatch, form: str) -> None:
    """Until wave 42 they were computed in float32 (torch.onnx translates symbolic floats as
    FLOAT): gradients 3e-8 to 6e-8 relative off from the second batch size on."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _Model(FORMS[form])
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (6, 4, 7):  # the second size captures with the batch left open
        x = torch.randn(rows, 4, dtype=torch.float64)
        expected, got = eager(x), wrapped(x)
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=0.0)
        grads = wrapped.linear.weight.grad, eager.linear.weight.grad
        torch.testing.assert_close(*grads, rtol=1e-14, atol=1e-300)
        eager.zero_grad()
        wrapped.zero_grad()


def test_a_float64_batch_norm_layer_trains_in_onnx_runtime_at_new_batch_sizes(monkeypatch) -> None:
    """Its decomposition at an open batch size divides a sum by ``sym_float(n)`` (through
    ``torch._refs.var_mean``, whose named tuple no translator knew): torch.onnx's float32 ``n``
    left a Div of float64 by float32, and until wave 44 the layer ran in PyTorch from the second
    batch size on (FALLBACK_DISABLE refused the model)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)).double()
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    for rows in (4, 6, 5, 7):
        x = torch.randn(rows, 8, dtype=torch.float64)
        for model, optimizer in zip((eager, wrapped), optimizers, strict=True):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        expected = eager.state_dict()
        for name, got in wrapped.state_dict().items():
            torch.testing.assert_close(got, expected[name], rtol=1e-12, atol=1e-14, msg=name)


class _Resampler(nn.Module):
    def __init__(self, scale_factor: float, mode: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.scale_factor, self.mode = scale_factor, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.interpolate(self.conv(x), scale_factor=self.scale_factor, mode=self.mode)


RESAMPLINGS = [(0.6, "nearest"), (1.7, "nearest-exact"), (0.7, "bilinear")]


@pytest.mark.parametrize(("scale_factor", "mode"), RESAMPLINGS)
def test_interpolation_at_new_image_sizes_reads_eager_source_pixels(monkeypatch, scale_factor, mode) -> None:
    """The source index scale ``n / (n * 0.6)`` was computed in float32 at an open size
    (1.6666665, Python's 1.6666667): nearest interpolation read row 4 where eager reads row 5,
    wrong losses and gradients from the second image size on, until wave 44."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _Resampler(scale_factor, mode)
    wrapped = ORTModule(copy.deepcopy(eager))
    for height, width in ((16, 16), (20, 18), (17, 23), (5, 7)):
        x = torch.randn(2, 2, height, width)
        expected, got = eager(x), wrapped(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        (expected * expected).mean().backward()
        (got * got).mean().backward()
        torch.testing.assert_close(wrapped.conv.weight.grad, eager.conv.weight.grad, rtol=1e-4, atol=1e-6)
        eager.zero_grad()
        wrapped.zero_grad()


class _PoolThenResample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4 * 9, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = nn.functional.max_pool2d(torch.tanh(self.conv(x)), 3, 2, padding=1)
        resampled = nn.functional.interpolate(pooled, scale_factor=1.5, mode="bilinear")
        # The adaptive pooling's backward reads the resampled size.
        return self.head(nn.functional.adaptive_max_pool2d(resampled, 3).flatten(1))


def test_a_size_with_float_arithmetic_reaches_the_backward_as_a_number(monkeypatch) -> None:
    """The backward reads the resampled size ``TruncToInt(1.5 * ToFloat(...))``, which no
    input tensor has: the export refused it ("cannot express size"), and the backward graph ran
    in PyTorch (refused under FALLBACK_DISABLE) until wave 44. It comes in as a number now."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # ONNX Runtime runs the whole graph
    torch.manual_seed(0)
    eager = _PoolThenResample()
    wrapped = ORTModule(copy.deepcopy(eager))
    for height, width in ((16, 16), (19, 21)):  # the second: the capture with open sizes
        x = torch.randn(2, 2, height, width)
        expected, got = eager(x), wrapped(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        expected.square().mean().backward()
        got.square().mean().backward()
        for mine, theirs in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6)
        eager.zero_grad()
        wrapped.zero_grad()


class _NumbersAsArguments(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        v = n / (n * 0.6) * 3  # Python: 5.0; in float32 arithmetic 4.9999995
        return x.clamp(min=v), torch.full_like(x, v), x.new_full((n, 2), v)


def test_a_number_from_open_sizes_passed_as_an_argument_is_rounded_once(monkeypatch) -> None:
    """``clamp(min=v)``, ``full_like(x, v)``: torch.onnx computed ``v`` in float32, 4.9999995 where
    eager's is 5.0 (and its floor 4), until wave 44."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    eager, wrapped = _NumbersAsArguments(), ORTModule(_NumbersAsArguments())
    for rows in (3, 17, 29):
        x = torch.zeros(rows, 2)
        for got, expected in zip(wrapped(x), eager(x), strict=True):
            assert torch.equal(got, expected)


class _ScaledBySize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (1 / (x.shape[1] * 20000))


def test_a_half_precision_graph_scaled_by_its_size_exports(monkeypatch) -> None:
    """Wave 44's float64 rebuild of a number passed as an argument first traced in the fake mode
    of the node's value, which in a float16 graph was not the inputs' ("Mixing fake modes NYI")."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    torch.manual_seed(0)
    eager = _ScaledBySize().half()
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (5, 7, 9):
        x = torch.randn(2, length, 8).half()
        expected, got = eager(x), wrapped(x)
        # float16 holds these products as subnormals: one step of 6e-8 apart at most
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1.2e-7)
