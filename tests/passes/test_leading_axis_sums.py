"""sum_leading_axes_by_matmul: ReduceSum over leading axes becomes ones @ x, with the same sums."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from _reductions import reduction_model, run_on_cpu
from onnx import TensorProto
from onnx_ir import convenience

from ortrain import ORTModule
from ortrain.ortmodule import DebugOptions
from ortrain.passes.leading_axis_sums import sum_leading_axes_by_matmul
from ortrain.passes.pipeline import default_passes


def _model(shape: list[int | str], axes: list[int], **kwargs: int) -> onnx.ModelProto:
    return reduction_model("ReduceSum", shape, axes, **kwargs)


@pytest.mark.parametrize(
    ("shape", "rows", "axes", "keepdims"),
    [
        (["n", 256], [512, 256], [0], 1),  # a bias gradient over a symbolic token count
        (["n", 256], [512, 256], [0], 0),
        ([8, "s", 64], [8, 100, 64], [0, 1], 1),  # a norm's gradient over batch and sequence
        ([8, "s", 64], [8, 100, 64], [1, 0], 0),
        ([4, 6, 8], [4, 6, 8], [-3], 1),  # negative axes, rank 3, one leading axis
        (["n", 256], [0, 256], [0], 1),  # no rows at all: zeros, as ReduceSum gives
    ],
)
def test_a_sum_over_leading_axes_is_a_product_with_the_same_values(
    shape: list[int | str], rows: list[int], axes: list[int], keepdims: int
) -> None:
    model = _model(shape, axes, keepdims=keepdims)
    rewritten = sum_leading_axes_by_matmul(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "ReduceSum" not in ops and "MatMul" in ops
    x = np.random.default_rng(0).standard_normal(rows).astype(np.float32)
    expected = run_on_cpu(model, x)
    got = run_on_cpu(rewritten, x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    summed = x.sum(axis=tuple(a % len(rows) for a in axes), keepdims=bool(keepdims))
    np.testing.assert_allclose(got, summed, atol=1e-4)


@pytest.mark.parametrize(
    ("shape", "axes", "dtype"),
    [
        ([512, 256], [1], TensorProto.FLOAT),  # a row sum: fast as it is
        ([8, 16, 64], [0, 2], TensorProto.FLOAT),  # not a leading run of axes
        ([512, 256], [0, 1], TensorProto.FLOAT),  # every axis
        ([512, "c"], [0], TensorProto.FLOAT),  # the summed rows' width is unknown
        ([512, 256], [0], TensorProto.DOUBLE),  # MatMul's float32 product only
    ],
)
def test_other_sums_stay(shape: list[int | str], axes: list[int], dtype: int) -> None:
    model = _model(shape, axes, dtype=dtype)
    assert [n.op_type for n in sum_leading_axes_by_matmul(model).graph.node] == ["ReduceSum"]


def test_in_the_default_pipeline() -> None:
    assert "sum_leading_axes_by_matmul" in [name for name, _ in default_passes(compute_optimizer=True)]


def test_bias_and_norm_gradients_match_eager_through_the_products(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="sums"))
    for rows in (512, 300):  # the second call: the graph with a symbolic row count
        x = torch.randn(rows, 32)
        for module in (eager, wrapped):
            module.zero_grad()
            module(x).square().mean().backward()
        for (name, a), b in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    backward = ir.load(tmp_path / "sums_backward_optimized_training.onnx")
    summed_axes = [
        convenience.get_const_tensor(n.inputs[1]).numpy().tolist()  # type: ignore[union-attr]
        for n in backward.graph
        if n.op_type == "ReduceSum"
    ]
    assert summed_axes == [[1], [1]]  # the norm's row sums stay; the sums over rows are products
    assert [n.op_type for n in backward.graph].count("MatMul") >= 3  # two biases, the norm's weight and bias
