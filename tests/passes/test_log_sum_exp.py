"""decompose_log_sum_exp: ReduceLogSumExp over the last axis as max, exp, sum and log, same values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from _reductions import reduction_model, run_on_cpu
from onnx import TensorProto

from ortrain.passes.log_sum_exp import decompose_log_sum_exp
from ortrain.passes.pipeline import default_passes


def _model(shape: list[int | str], axes: list[int], **kwargs: int) -> onnx.ModelProto:
    return reduction_model("ReduceLogSumExp", shape, axes, **kwargs)


@pytest.mark.parametrize(("axes", "keepdims"), [([-1], 1), ([3], 0)])
def test_the_decomposition_gives_the_kernels_values_also_for_infinite_rows(
    axes: list[int], keepdims: int
) -> None:
    model = _model(["b", 4, 16, 16], axes, keepdims=keepdims)
    rewritten = decompose_log_sum_exp(model)
    assert "ReduceLogSumExp" not in [n.op_type for n in rewritten.graph.node]
    x = (
        np.random.default_rng(0).standard_normal((2, 4, 16, 16)).astype(np.float32) * 30
    )  # exp overflows unshifted
    x[..., np.triu_indices(16, 1)[0], np.triu_indices(16, 1)[1]] = -np.inf  # a causal mask
    x[0, 0, 3] = -np.inf  # a row masked whole: -inf
    x[0, 1, 5, 2] = np.inf  # a row holding +inf: +inf
    x[1, 2, 7, 0] = np.nan  # a row holding NaN: NaN
    expected = run_on_cpu(model, x)
    got = run_on_cpu(rewritten, x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)
    reference = torch.logsumexp(torch.from_numpy(x), dim=-1, keepdim=bool(keepdims)).numpy()
    np.testing.assert_allclose(got, reference, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    ("axes", "dtype"), [([1], TensorProto.FLOAT), ([2, 3], TensorProto.FLOAT), ([-1], TensorProto.DOUBLE)]
)
def test_other_log_sum_exps_stay(axes: list[int], dtype: int) -> None:
    model = _model([2, 4, 16, 16], axes, dtype=dtype)
    assert [n.op_type for n in decompose_log_sum_exp(model).graph.node] == ["ReduceLogSumExp"]


def test_in_the_default_pipeline() -> None:
    assert "decompose_log_sum_exp" in [name for name, _ in default_passes(compute_optimizer=True)]
