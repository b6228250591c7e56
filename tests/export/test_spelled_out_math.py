"""Operators whose onnxscript translations lose PyTorch's answers give PyTorch's answers in ONNX
Runtime: signed zeros, infinities, NaN, subnormals and large magnitudes included."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.export.spelled_out_math import spell_out_math

aten = torch.ops.aten

# (no quotient of two finite ones overflows: PyTorch's own fmod is NaN there in its vector kernel)
_SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, -3.0, 0.1, 5.0, 1000.0, -501.0, 1e8, -1e-20, 1e-20]
_SPECIAL += [float("inf"), float("-inf"), float("nan"), -120.0, 95.0, -30.0, -15.0, 32768.0, 1e9]

_FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "atan2": torch.atan2,
    "sigmoid": lambda y, x: torch.sigmoid(y),  # ONNX Runtime's kernel: 0 at -30, not 9.4e-14
    # wave 45: through ONNX Runtime's Sigmoid, silu was 0 from -20 on (PyTorch: -4.1e-8 at -20)
    "silu": lambda y, x: torch.nn.functional.silu(y),
    "silu backward": lambda y, x: torch.ops.aten.silu_backward.default(x, y),
    # wave 47: ONNX Runtime's Elu and Celu compute exp(x) - 1, elu(-1e-6) 1.3% off PyTorch's expm1
    "elu scaled by a number": lambda y, x: torch.nn.functional.elu(y * 1e-6, alpha=0.7),
    "celu scaled by a number": lambda y, x: torch.nn.functional.celu(y * 1e-6, alpha=1.3),
    # log(x) / log(2) in float32: log2(32768) was 14.999999, its floor 14
    "log2 floor": lambda y, x: torch.log2(y.abs()).floor(),
    "log10 floor": lambda y, x: torch.log10(y.abs()).floor(),
    "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2,
    "remainder": torch.remainder,
    "remainder by a number": lambda y, x: torch.remainder(y, 0.1),
    "floor division": lambda y, x: torch.div(y, x, rounding_mode="floor"),
    "floor division by a number": lambda y, x: torch.div(y, 0.1, rounding_mode="floor"),
    # wave 37: ONNX Runtime's Sign is NaN at NaN (PyTorch: 0); onnxscript's logit clamp made NaN 1 - eps
    "sign": lambda y, x: torch.sign(y),
    "logit": lambda y, x: torch.logit(y),
    "logit with eps": lambda y, x: torch.logit(y, eps=1e-6),
    # wave 53: onnxscript's signbit is x < 0, False at -0.0
    "signbit": lambda y, x: torch.signbit(y).float(),
}


def _pairs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = list(itertools.product(_SPECIAL, _SPECIAL))
    return (
        torch.tensor([y for y, _ in pairs], dtype=dtype),
        torch.tensor([x for _, x in pairs], dtype=dtype),
    )


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, name: str, *, zero_signs: bool = True) -> None:
    """Equal to a float32 rounding (absolute near 0: logaddexp2(-1, -1) is -1e-8 in PyTorch), NaN
    where PyTorch has NaN, and the same sign on zeros where the sign is the answer's."""
    tails = ("sigmoid", "silu", "elu scaled by a number", "celu scaled by a number")
    atol = 0.0 if name in tails else 1e-7  # their tails are what they are about
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=1e-6, atol=atol)
    if zero_signs and not name.startswith("logaddexp"):  # there a zero is a rounding of ±1e-8
        zeros = expected == 0
        assert torch.equal(torch.signbit(actual[zeros]), torch.signbit(expected[zeros]))


@pytest.mark.parametrize("name", list(_FORMS))
def test_the_spelled_out_form_is_pytorchs(name: str) -> None:
    y, x = _pairs(torch.float32)
    gm = make_fx(_FORMS[name], tracing_mode="fake")(y, x)
    assert spell_out_math(gm) == 1
    _assert_same(gm(y, x), _FORMS[name](y, x), name)


def test_integer_operands_are_promoted_as_pytorch_promotes_them() -> None:
    def f(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.atan2(y, x) + y.float()

    gm = make_fx(f, tracing_mode="fake")(torch.tensor([1]), torch.tensor([2]))
    # atan2 of integers is float: spelled out on float copies of the operands
    assert spell_out_math(gm) == 1
    y, x = torch.tensor([0, 3]), torch.tensor([-2, 0])
    torch.testing.assert_close(gm(y, x), f(y, x))


def test_integer_remainders_and_truncations_are_left_to_the_exporter() -> None:
    def f(y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y % x, torch.div(y, x, rounding_mode="floor"), torch.div(y.float(), x, rounding_mode="trunc")

    gm = make_fx(f, tracing_mode="fake")(torch.tensor([7]), torch.tensor([2]))
    assert spell_out_math(gm) == 0  # Mod raises on a zero divisor; trunc rounds the exact quotient


# (ONNX Runtime has no float64 Atan kernel on the CPU: such graphs run in PyTorch)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "torch.onnx.export"])
def test_onnx_runtime_gives_pytorchs_answers(
    direct: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime as ort

    from ortrain.export import fx_to_onnx

    monkeypatch.setattr(fx_to_onnx, "DIRECT_TRANSLATION", direct)

    forms = {**_FORMS, "atan2 by a 0-d tensor": lambda y, x: torch.atan2(y, x[:1].sum().neg())}
    if dtype == torch.float16:
        # The export makes a number operand a tensor of the other operand's dtype (0.1: 0.09998),
        # where PyTorch's float16 kernels take some numbers in float32 (floor division) and others
        # rounded (remainder): a rounding of the number, not of these forms; left as it is. And
        # ONNX Runtime computes a float16 Floor in float32, dropping the rounding to float16
        # before it (its cast elimination), so floor(log10(0.1)) is -2 where PyTorch's is -1.
        forms = {
            name: form
            for name, form in forms.items()
            if not name.endswith("by a number") and not name.endswith("floor")
        }

    def f(y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(form(y, x) for form in forms.values())

    y, x = _pairs(dtype)
    exported = fx_to_onnx.export_graph(make_fx(f, tracing_mode="fake")(y, x), opset_version=18)
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    results = session.run(None, dict(zip(inputs, (y.numpy(), x.numpy()), strict=True)))
    # before wave 35: atan2(0, -1) was -π, sigmoid(-30) 0, logaddexp(-120, -120) -inf,
    # 5.0 % 0.1 zero, 5.0 // 0.1 50, 1e8 % -501 off by 8
    for got, expected, name in zip(results, f(y, x), forms, strict=True):
        # ONNX Runtime's Where drops a zero's sign in its first branch (elu(-0) is 0 there)
        zero_signs = "elu" not in name
        _assert_same(torch.from_numpy(np.asarray(got)).float(), expected.float(), name, zero_signs=zero_signs)


class _PairwiseRanking(torch.nn.Module):
    """A BPR loss as often written: ``-log(sigmoid(pos - neg))``."""

    def __init__(self) -> None:
        super().__init__()
        self.items = torch.nn.Embedding(6, 4)

    def forward(self, user: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        margin = (user * self.items(pos)).sum(-1) - (user * self.items(neg)).sum(-1)
        return -torch.log(torch.sigmoid(margin)).mean()


def test_a_hand_written_log_sigmoid_stays_finite_in_onnx_runtime() -> None:
    """Wave 35: ONNX Runtime's Sigmoid was 0 at a margin of -30, so the loss was inf and every
    gradient NaN where eager's loss is 10."""
    import copy

    from ortrain import ORTModule

    torch.manual_seed(0)
    model = _PairwiseRanking()
    wrapped = ORTModule(copy.deepcopy(model))
    user = torch.tensor([[3.0, 3.0, 3.0, 3.0], [0.1, 0.2, 0.3, 0.4]])
    with torch.no_grad():  # item 1 scores 30 below item 2 for the first user
        model.items.weight[1].fill_(0.0)
        model.items.weight[2].fill_(2.5)
        wrapped.module.items.weight.copy_(model.items.weight)
    pos, neg = torch.tensor([1, 3]), torch.tensor([2, 4])
    expected, got = model(user, pos, neg), wrapped(user, pos, neg)
    assert torch.isfinite(expected)
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    torch.testing.assert_close(wrapped.module.items.weight.grad, model.items.weight.grad)


class _SignGate(torch.nn.Module):
    """A mask of the negative weights (-0.0 among them) gates both a value and a gradient."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([-0.0, 0.0, -1.0, 1.0, -1e-30], dtype=dtype))

    def forward(self) -> torch.Tensor:
        negative = torch.signbit(self.w)
        return torch.where(negative, 10.0, 20.0) + self.w * negative


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_signbit_of_a_negative_zero_is_true_in_onnx_runtime(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wave 53: -0.0 was not negative, so its value was 20 and its gradient 0 (eager: 10 and 1)."""
    from ortrain import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # ONNX Runtime's answer

    model, wrapped = _SignGate(dtype), ORTModule(_SignGate(dtype))
    expected, got = model(), wrapped()
    torch.testing.assert_close(got, expected)
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(wrapped.module.w.grad, model.w.grad)
