"""``atan2`` exported to ONNX Runtime answers what PyTorch answers, signed zeros, infinities and
NaN included."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.export.atan2_quadrants import spell_out_atan2

aten = torch.ops.aten

_SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, -3.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30]


def _pairs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = list(itertools.product(_SPECIAL, _SPECIAL))
    return (
        torch.tensor([y for y, _ in pairs], dtype=dtype),
        torch.tensor([x for _, x in pairs], dtype=dtype),
    )


def _assert_same_angles(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to a float32 rounding, NaN where PyTorch has NaN, and the same sign on zeros."""
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=4e-7)
    zeros = expected == 0
    assert torch.equal(torch.signbit(actual[zeros]), torch.signbit(expected[zeros]))


def test_the_spelled_out_form_is_pytorchs_atan2() -> None:
    def f(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.atan2(y, x)

    y, x = _pairs(torch.float32)
    gm = make_fx(f, tracing_mode="fake")(y, x)
    assert spell_out_atan2(gm) == 1
    assert aten.atan2.default not in {n.target for n in gm.graph.nodes}
    _assert_same_angles(gm(y, x), torch.atan2(y, x))


def test_integer_operands_are_promoted_as_pytorch_promotes_them() -> None:
    def f(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.atan2(y, x) + y.float()

    gm = make_fx(f, tracing_mode="fake")(torch.tensor([1]), torch.tensor([2]))
    # atan2 of integers is float: spelled out on float copies of the operands
    assert spell_out_atan2(gm) == 1
    torch.testing.assert_close(
        gm(torch.tensor([0, 3]), torch.tensor([-2, 0])), f(torch.tensor([0, 3]), torch.tensor([-2, 0]))
    )


# (ONNX Runtime has no float64 Atan kernel on the CPU: such graphs run in PyTorch)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "torch.onnx.export"])
def test_onnx_runtime_gets_every_quadrant_right(
    direct: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime as ort

    from ortrain.export import fx_to_onnx

    monkeypatch.setattr(fx_to_onnx, "DIRECT_TRANSLATION", direct)

    def f(y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a broadcast 0-d operand too, as torch.atan2(h, torch.tensor(-1.0)) traces
        return torch.atan2(y, x), torch.atan2(y, x[:1].sum().neg())

    y, x = _pairs(dtype)
    exported = fx_to_onnx.export_graph(make_fx(f, tracing_mode="fake")(y, x), opset_version=18)
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    angles, broadcast = session.run(None, dict(zip(names, (y.numpy(), x.numpy()), strict=True)))
    expected, expected_broadcast = f(y, x)
    # before ortrain spelled it out: atan2(0, -1) was -π, atan2(±inf, ±inf) and atan2(nan, 1) 0
    _assert_same_angles(torch.from_numpy(np.asarray(angles)).float(), expected.float())
    _assert_same_angles(torch.from_numpy(np.asarray(broadcast)).float(), expected_broadcast.float())
