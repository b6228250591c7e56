"""Training with half-precision activations through float32 norms: autocast, or norms kept float32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule


@pytest.fixture(autouse=True)
def _half_precision_ops_in_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    # ONNX Runtime's CPU build has no bfloat16 convolution or matmul: those run in PyTorch.
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")


class _ConvNet(nn.Module):
    def __init__(self, norm: nn.Module, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(dtype)
        self.norm = norm  # float32 whatever the rest is
        self.head = nn.Linear(4, 3).to(dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.conv(x.to(self.dtype))))
        return F.cross_entropy(self.head(h.mean((2, 3))).float(), y)


def _train(model: nn.Module, autocast: torch.dtype | None, steps: int = 3) -> tuple[list[float], nn.Module]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def _assert_trains_like_eager(model: nn.Module, autocast: torch.dtype | None) -> None:
    eager_losses, eager = _train(copy.deepcopy(model), autocast)
    wrapped = ORTModule(model)
    losses, _ = _train(wrapped, autocast)
    assert not wrapped._ortrain_fallback.active, wrapped._ortrain_fallback.reason
    assert losses == pytest.approx(eager_losses, rel=1e-3)
    for (name, p), q in zip(eager.state_dict().items(), wrapped.module.state_dict().values(), strict=True):
        if p.is_floating_point():
            torch.testing.assert_close(q, p, atol=1e-3, rtol=1e-2, msg=name)


# Batch norm (the one whose statistics crossed the cut) under both autocast dtypes; the others
# under one each, between them both.
@pytest.mark.parametrize(
    ("norm", "autocast"),
    [
        ("batch", torch.bfloat16),
        ("batch", torch.float16),
        ("instance", torch.float16),
        ("group", torch.bfloat16),
    ],
)
def test_autocast_training_through_a_norm_that_keeps_float32_parameters(
    norm: str, autocast: torch.dtype
) -> None:
    # The loss ignores labels (cross_entropy's ignore_index), so the gather of counted rows splits
    # the graphs between ONNX Runtime and PyTorch: batch norm's saved statistics crossed it as
    # bfloat16 and PyTorch's backward refused them ("mixed dtype (CPU)").
    layers = {
        "batch": lambda: nn.BatchNorm2d(4),
        "instance": lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        "group": lambda: nn.GroupNorm(2, 4),
    }
    torch.manual_seed(0)
    _assert_trains_like_eager(_ConvNet(layers[norm]()), autocast)


def test_a_half_precision_model_with_a_float32_group_norm() -> None:
    # ONNX Runtime ran the group norm's decomposition on values the graph said were float16 and
    # found float32 ones ("Unexpected input data type").
    torch.manual_seed(0)
    _assert_trains_like_eager(_ConvNet(nn.GroupNorm(2, 4), torch.float16), autocast=None)


class _BreaksAfterItsNorm(_ConvNet):
    """A Python number read from a tensor: TorchDynamo splits the forward there (graph-break path)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.conv(x.to(self.dtype))))
        scale = 1.0 / max(float(h.detach().abs().amax()), 1.0)
        return F.cross_entropy(self.head(h.mean((2, 3)) * scale).float(), y)


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_autocast_training_through_graph_breaks(norm: str) -> None:
    # Wave 34: TorchDynamo's graphs call torch.group_norm / torch.batch_norm, under F's wrappers;
    # AOTAutograd traced them whole there, and ONNX Runtime received bfloat16 for a float32 input.
    torch.manual_seed(0)
    layer = nn.BatchNorm2d(4) if norm == "batch" else nn.GroupNorm(2, 4)
    _assert_trains_like_eager(_BreaksAfterItsNorm(layer), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_with_batch_norm_stays_on_onnx_runtime(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """PyTorch's batch norm returns a half-precision model's new running statistics in its dtype
    where the trace has float32: the ONNX Runtime region reading them refused the input, and until
    wave 43 the model trained in PyTorch for good."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    wrapped = ORTModule(copy.deepcopy(model))
    for _ in range(3):
        x = torch.randn(6, 8).to(dtype)
        losses = [m(x).float().square().mean() for m in (model, wrapped)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0])
        torch.testing.assert_close(wrapped.module[1].running_var, model[1].running_var)
        torch.testing.assert_close(wrapped.module[3].weight.grad, model[3].weight.grad)
    assert not wrapped._ortrain_fallback.active


class _Float32Region(nn.Module):
    """A layer under ``autocast(enabled=False)`` inside a bfloat16 autocast forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            h = self.fp32(x)
        return self.head(h)


def _backward_in_autocast(model: nn.Module, x: torch.Tensor, *, backward_inside: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()


def test_a_float32_region_under_autocast_keeps_float32_gradients(caplog: pytest.LogCaptureFixture) -> None:
    """AOTAutograd traced the backward under the forward's autocast: the float32 layer's weight
    gradient came out rounded to bfloat16 (2e-3 relative off eager's) until wave 44."""
    torch.manual_seed(0)
    eager = _Float32Region()
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (4, 6):
        x = torch.randn(rows, 32)
        for model in (eager, wrapped):
            model.zero_grad()
            _backward_in_autocast(model, x, backward_inside=False)
        for got, expected in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-6, atol=1e-7)
    assert "backward() ran inside torch.autocast" not in caplog.text


def test_a_backward_inside_autocast_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from ortrain.ortmodule import backward_under_autocast

    torch.manual_seed(0)
    wrapped = ORTModule(_Float32Region())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backward_under_autocast, "_warned", False)
        for _ in range(2):
            _backward_in_autocast(wrapped, torch.randn(4, 32), backward_inside=True)
        warnings = [r for r in caplog.records if "backward() ran inside torch.autocast" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


class _ConvThenLayerNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x).transpose(1, 2)).float().square().mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_layer_norm_of_an_autocast_activation_trains(dtype: torch.dtype) -> None:
    """PyTorch's layer norm returns float32 statistics for a half-precision input where its fake
    kernel says half: wave 43's cast of PyTorch's outputs to the traced dtype handed them to the
    backward's layer norm in half precision, which refused them ("expected scalar type Float but
    found BFloat16"). Only ONNX Runtime's inputs are cast now."""
    torch.manual_seed(0)
    eager = _ConvThenLayerNorm()
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (5, 7):
        x = torch.randn(2, 8, length)
        for model in (eager, wrapped):
            model.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x)
            loss.backward()
        for got, expected in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-2, atol=1e-4)
