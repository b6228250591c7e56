"""Half-precision inputs to float32 norms are computed in float32 while capturing."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ortrain.capture import mixed_precision_norms as norms
from ortrain.capture.function_overrides import dynamo_graph_overrides

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
def test_batch_norm_matches_the_mixed_kernel_and_updates_float32_statistics(dtype: torch.dtype) -> None:
    x = torch.randn(6, 4, 5).to(dtype)
    weight, bias = torch.rand(4) + 0.5, torch.randn(4)
    mean, var = torch.zeros(4), torch.ones(4)
    mean_ref, var_ref = mean.clone(), var.clone()

    out = norms.batch_norm(x, mean, var, weight, bias, True, 0.1, 1e-5)
    ref = F.batch_norm(x, mean_ref, var_ref, weight, bias, True, 0.1, 1e-5)

    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    assert mean.dtype == var.dtype == torch.float32
    torch.testing.assert_close(mean, mean_ref)
    torch.testing.assert_close(var, var_ref)


@pytest.mark.parametrize("dtype", HALF)
def test_group_and_instance_norm_match_the_mixed_kernels(dtype: torch.dtype) -> None:
    x = torch.randn(3, 4, 5, 5).to(dtype)
    weight, bias = torch.rand(4) + 0.5, torch.randn(4)
    group = norms.group_norm(x, 2, weight, bias, 1e-5)
    instance = norms.instance_norm(x, None, None, weight, bias, True, 0.1, 1e-5)
    assert group.dtype == instance.dtype == dtype
    torch.testing.assert_close(group, F.group_norm(x, 2, weight, bias), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(instance, F.instance_norm(x, weight=weight, bias=bias), atol=1e-2, rtol=1e-2)


def test_calls_without_the_mix_are_left_to_pytorch() -> None:
    stats = torch.zeros(4), torch.ones(4)
    # float32 input; half input with half parameters; half input with no parameters at all
    assert norms.batch_norm(torch.randn(2, 4), *stats) is NotImplemented
    half_stats = (s.bfloat16() for s in stats)
    assert norms.batch_norm(torch.randn(2, 4).bfloat16(), *half_stats) is NotImplemented
    assert norms.group_norm(torch.randn(2, 4).bfloat16(), 2) is NotImplemented
    # float64 parameters with a half input: PyTorch refuses that mix itself
    assert norms.group_norm(torch.randn(2, 4).half(), 2, torch.ones(4, dtype=torch.float64)) is NotImplemented


def test_the_mode_takes_torchs_own_argument_order() -> None:
    # TorchDynamo's graphs call torch.batch_norm(input, weight, bias, mean, var, ...) directly.
    x = torch.randn(6, 4).bfloat16()
    weight, bias = torch.rand(4) + 0.5, torch.randn(4)
    mean, var = torch.zeros(4), torch.ones(4)
    mean_ref, var_ref = mean.clone(), var.clone()
    with dynamo_graph_overrides():
        out = torch.batch_norm(x, weight, bias, mean, var, True, 0.1, 1e-5, False)
        group = torch.group_norm(x.view(6, 4, 1), 2, weight, bias, 1e-5, False)
    ref = F.batch_norm(x, mean_ref, var_ref, weight, bias, True, 0.1, 1e-5)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(mean, mean_ref)
    torch.testing.assert_close(group, F.group_norm(x.view(6, 4, 1), 2, weight, bias), atol=1e-2, rtol=1e-2)
