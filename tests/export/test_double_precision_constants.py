"""A float64 model's Python floats reach ONNX Runtime as float64 constants: its values and
gradients are eager's to the last bits, not to float32's rounding of each constant."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain import ORTModule
from ortrain.export.double_precision_constants import all_floats_double

FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "x * 0.1": lambda x: x * 0.1,
    "x + pi": lambda x: x + torch.pi,
    "x / 3.3": lambda x: x / 3.3,
    "0.3 - x": lambda x: 0.3 - x,
    "clamp(min=0.7)": lambda x: x.clamp(min=0.7),
    "where(x > 0.5, 0.1, x)": lambda x: torch.where(x > 0.5, 0.1, x),
    "full_like(x, 0.1) * x": lambda x: torch.full_like(x, 0.1) * x,
    "lerp(x, 2x, 0.3)": lambda x: torch.lerp(x, 2 * x, 0.3),
    "threshold(x, 0.55, 0.3)": lambda x: nn.functional.threshold(x, 0.55, 0.3),
    # numbers that translations make ONNX attributes, float32 by the format
    "addcmul(x, x, x, value=0.3)": lambda x: torch.addcmul(x, x, x, value=0.3),
    "addcdiv(x, x, x + 1, value=0.3)": lambda x: torch.addcdiv(x, x, x + 1, value=0.3),
    "hardtanh(x, 0.2, 0.8)": lambda x: nn.functional.hardtanh(x, 0.2, 0.8),
    "addbmm(x, x, x, beta=0.6, alpha=0.2)": lambda x: torch.addbmm(
        x[:3], x.view(2, 3, 1), x.view(2, 1, 3), beta=0.6, alpha=0.2
    ).flatten()[:6],
}


class _Form(nn.Module):
    def __init__(self, form: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        self.form = form
        self.scale = nn.Parameter(torch.linspace(0.9, 1.1, 6, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.form(x * self.scale)


@pytest.mark.parametrize("form", list(FORMS), ids=str)
def test_float64_forms_match_eager_to_double_precision(form: str) -> None:
    eager = _Form(FORMS[form], torch.float64)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.linspace(0.15, 0.95, 6, dtype=torch.float64)
    expected, got = eager(x), wrapped(x)
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=0.0)
    (expected * torch.arange(1.0, 7.0, dtype=torch.float64)).sum().backward()
    (got * torch.arange(1.0, 7.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(wrapped.module.scale.grad, eager.scale.grad, rtol=1e-15, atol=0.0)


def test_float32_forms_keep_float32_constants() -> None:
    """The switch is for float64 graphs only: float32 models compute as before (and as eager)."""
    for form in FORMS.values():
        eager = _Form(form, torch.float32)
        wrapped = ORTModule(copy.deepcopy(eager))
        x = torch.linspace(0.15, 0.95, 6)
        got = wrapped(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, eager(x))


def test_addbmm_with_beta_0_ignores_nan_in_its_input_as_eager() -> None:
    """PyTorch's ``beta=0`` ignores ``input``; onnxscript's multiplied it by 0, NaN staying NaN."""

    class _Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.batch = nn.Parameter(torch.randn(3, 2, 4))

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return torch.addbmm(input, self.batch, self.batch.transpose(1, 2), beta=0, alpha=0.5)

    eager = _Sum()
    wrapped = ORTModule(copy.deepcopy(eager))
    input = torch.tensor([[float("nan"), 1.0], [float("inf"), 2.0]])
    expected, got = eager(input), wrapped(input)
    torch.testing.assert_close(got, expected)
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(wrapped.module.batch.grad, eager.batch.grad)


class _Nearest(nn.Module):
    """Python floats after a nearest upsampling, whose decomposition computes its source indices
    in float32 whatever the model's dtype."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.scale = nn.Parameter(torch.linspace(0.9, 1.1, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = nn.functional.interpolate(x * self.scale[:, None], scale_factor=0.6, mode=self.mode)
        return h + 0.1, h.norm(p=3, dim=-1)


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
def test_float64_model_with_nearest_upsampling_keeps_double_constants(mode: str) -> None:
    """Until wave 54 upsample-nearest's float32 index arithmetic made the graph count as mixed:
    ``0.1`` and the norm's ``1/3`` became float32 constants (3e-8 off in value and gradient).
    The second length is open: there the index scale comes from double_precision_sizes."""
    eager = _Nearest(mode)
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (17, 13):
        x = torch.linspace(-1.0, 1.3, 2 * 4 * length, dtype=torch.float64).reshape(2, 4, length)
        expected, got = eager(x), wrapped(x)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=0.0)
        sum(e.sum() for e in expected).backward()
        sum(g.sum() for g in got).backward()
        torch.testing.assert_close(wrapped.module.scale.grad, eager.scale.grad, rtol=1e-12, atol=0.0)


def _traced(f: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> torch.fx.GraphModule:
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    return make_fx(f, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x)


def test_only_index_arithmetic_of_float32_is_left_out_of_the_float64_judgement() -> None:
    """Float32 values that the model's tensors flow into, or that reach a floating result,
    still make the graph mixed: there a DOUBLE constant could meet a float32 tensor."""

    def nearest(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (nn.functional.interpolate(x, size=5, mode="nearest") + 0.1,)

    def nearest_and_float32_output(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*nearest(x), x.float() * 0.1)

    def float32_index_from_the_model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        index = (x[0, 0].float() * 2.5).abs().long().clamp(max=2)
        return (x[..., index] + 0.1,)

    def float32_boundaries_met_by_the_model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        boundaries = torch.linspace(-1.0, 1.0, 4, dtype=torch.float32)  # integers out, not by a cast
        return (x[..., torch.bucketize(x[0, 0], boundaries).clamp(max=2)] + 0.1,)

    assert all_floats_double(_traced(nearest))
    assert not all_floats_double(_traced(float32_boundaries_met_by_the_model))
    assert not all_floats_double(_traced(nearest_and_float32_output))
    assert not all_floats_double(_traced(float32_index_from_the_model))
