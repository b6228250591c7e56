"""powers_as_products: Pow by 1, 2, 3, ±0.5, -1, -2 as PyTorch's kernel computes it, eager's values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from _eager_parity import one_step_against_eager
from onnx import TensorProto, helper, numpy_helper

from ortrain.passes.pipeline import default_passes
from ortrain.passes.scalar_powers import powers_as_products

_N = 1 << 16


def _pow_model(exponent: np.ndarray, dtype: int, base_shape: list[int] | None = None) -> onnx.ModelProto:
    shape = base_shape or [_N]
    graph = helper.make_graph(
        [helper.make_node("Pow", ["x", "e"], ["y"])],
        "pow",
        [helper.make_tensor_value_info("x", dtype, shape)],
        [helper.make_tensor_value_info("y", dtype, None)],
        [numpy_helper.from_array(exponent, "e")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _values(dtype: type) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(_N) * np.exp(rng.uniform(-20, 20, _N))).astype(dtype)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, -3.0]
    return x


@pytest.mark.parametrize("exponent", [1.0, 2.0, 3.0, 0.5, -0.5, -1.0, -2.0])
@pytest.mark.parametrize(
    ("dtype", "numpy_dtype"), [(TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64)]
)
def test_eagers_values(exponent: float, dtype: int, numpy_dtype: type) -> None:
    model = _pow_model(np.array(exponent, numpy_dtype), dtype)
    rewritten = powers_as_products(model)
    assert "Pow" not in [n.op_type for n in rewritten.graph.node]
    x = _values(numpy_dtype)
    got = _run(rewritten, x)
    expected = torch.from_numpy(x).pow(exponent).numpy()
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)  # pow(-inf, ±0.5) included: NaN, as eager
    if exponent == 0.5:
        # ONNX Runtime's Sqrt rounds correctly; PyTorch's vectorized sqrt can be one unit off.
        np.testing.assert_array_equal(got[~nan], np.sqrt(x[~nan]))
        assert np.signbit(got[1]) and np.signbit(expected[1])  # sqrt(-0.0) is -0.0; pow() gave +0.0
        np.testing.assert_allclose(got[~nan], expected[~nan], rtol=2 * np.finfo(numpy_dtype).eps, atol=0)
    else:
        bits = np.dtype(f"int{np.dtype(numpy_dtype).itemsize * 8}")
        np.testing.assert_array_equal(got[~nan].view(bits), expected[~nan].view(bits))


def test_onnx_runtimes_pow_gave_other_values() -> None:
    """What the rewrite changes: 1 / x² rounded once, and pow(-inf, 0.5) infinite."""
    x = _values(np.float32)
    inverse_square = _run(_pow_model(np.array(-2.0, np.float32), TensorProto.FLOAT), x)
    eager = torch.from_numpy(x).pow(-2.0).numpy()
    finite = np.isfinite(eager)
    assert (inverse_square[finite] != eager[finite]).any()
    root = _run(_pow_model(np.array(0.5, np.float32), TensorProto.FLOAT), x)
    assert root[3] == np.inf and np.isnan(torch.tensor(-np.inf).pow(0.5).item())


@pytest.mark.parametrize(
    ("exponent", "dtype", "base_shape"),
    [
        (np.array(2.5, np.float32), TensorProto.FLOAT, None),  # another exponent
        (np.array([2.0, 2.0], np.float32), TensorProto.FLOAT, None),  # not one element
        (np.array([[2.0]], np.float32), TensorProto.FLOAT, [_N]),  # would widen the base's shape
        (np.array(2, np.int64), TensorProto.INT64, None),  # an integer base
    ],
)
def test_other_powers_stay(exponent: np.ndarray, dtype: int, base_shape: list[int] | None) -> None:
    model = _pow_model(exponent, dtype, base_shape)
    assert powers_as_products(model) is model


def test_in_the_default_pipeline() -> None:
    assert "powers_as_products" in [name for name, _ in default_passes(compute_optimizer=True)]


class _RMSNormBlock(torch.nn.Module):
    """Llama's RMSNorm: a square, a mean, rsqrt; its backward cubes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(64) + 0.5)
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.proj(normed).pow(2).mean()


def test_rms_norm_trains_as_eager(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    h = torch.randn(16, 32, 64)
    _, graphs = one_step_against_eager(
        _RMSNormBlock, h, monkeypatch=monkeypatch, tmp_path=tmp_path, atol=1e-7
    )
    for name, graph in graphs.items():
        assert "Pow" not in [n.op_type for n in graph.graph.node], name
