"""ortrain's own decompositions against PyTorch's native kernels."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.nn import functional as F

from ortrain.capture import decompositions_bessel as bessel
from ortrain.capture import decompositions_embedding as embedding
from ortrain.capture import decompositions_gathers as gathers
from ortrain.capture import decompositions_indexing as indexing
from ortrain.capture import decompositions_losses as losses
from ortrain.capture import decompositions_math as math_ops
from ortrain.capture import decompositions_pooling as pooling
from ortrain.capture import decompositions_special as special
from ortrain.capture.decompositions import convolution_backward, input_gradient_of_any_size
from ortrain.capture.decompositions_pooling import adaptive_avg_pool2d_backward

aten = torch.ops.aten

CONV_CASES = [
    # (spatial dims, in channels, out channels, kernel, stride, padding, dilation, groups, size)
    (2, 4, 6, 3, 1, 1, 1, 1, 9),
    (2, 4, 6, 3, 2, 0, 1, 2, 10),
    (2, 6, 6, 3, 2, 2, 2, 6, 11),  # depthwise, dilated, stride leaving a remainder
    (2, 3, 4, 1, 1, 0, 1, 1, 5),
    (2, 4, 8, 5, 3, 1, 1, 4, 13),
    (1, 4, 6, 3, 2, 1, 1, 2, 12),
    (3, 2, 4, 3, 2, 1, 1, 1, 7),
]


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_convolution_backward_matches_native(case: tuple, mask: tuple[bool, bool, bool]) -> None:
    dims, c_in, c_out, k, stride, padding, dilation, groups, size = case
    torch.manual_seed(0)
    x = torch.randn(3, c_in, *([size] * dims), dtype=torch.float64)
    w = torch.randn(c_out, c_in // groups, *([k] * dims), dtype=torch.float64)
    args = ([stride] * dims, [padding] * dims, [dilation] * dims)
    y = aten.convolution(x, w, None, *args, False, [0] * dims, groups)
    g = torch.randn_like(y)
    want = aten.convolution_backward(g, x, w, [c_out], *args, False, [0] * dims, groups, list(mask))
    got = convolution_backward(g, x, w, [c_out], *args, False, [0] * dims, groups, mask)
    for a, b, needed in zip(got, want, mask, strict=True):
        if needed:
            torch.testing.assert_close(a, b)
        else:
            assert a is None


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_input_gradient_for_a_size_the_stride_may_not_divide_matches_native(case: tuple, extra: int) -> None:
    """The form used where the output padding is symbolic (ONNX wants a fixed number): the full
    transposed convolution, zeros for trailing positions the stride skipped, the input's window."""
    dims, c_in, c_out, k, stride, padding, dilation, groups, size = case
    torch.manual_seed(0)
    x = torch.randn(2, c_in, *([size + extra] * dims), dtype=torch.float64)
    w = torch.randn(c_out, c_in // groups, *([k] * dims), dtype=torch.float64)
    args = ([stride] * dims, [padding] * dims, [dilation] * dims)
    g = torch.randn_like(aten.convolution(x, w, None, *args, False, [0] * dims, groups))
    want = aten.convolution_backward(g, x, w, [c_out], *args, False, [0] * dims, groups, [True, False, False])
    got = input_gradient_of_any_size(g, w, list(x.shape[2:]), *args, groups)
    torch.testing.assert_close(got, want[0])


@pytest.mark.parametrize(
    ("size", "out"), list(itertools.product([(8, 8), (7, 10)], [(1, 1), (2, 4), (3, 3)]))
)
def test_adaptive_avg_pool2d_backward_matches_native(size: tuple[int, int], out: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    g = torch.randn(2, 3, *out, dtype=torch.float64)
    torch.testing.assert_close(adaptive_avg_pool2d_backward(g, x), aten._adaptive_avg_pool2d_backward(g, x))


# ---- transposed convolution backward --------------------------------------------------------------

TRANSPOSED_CASES = [
    # (spatial dims, in channels, out channels, kernel, stride, padding, output padding, dilation, groups)
    (2, 4, 6, 3, 1, 1, 0, 1, 1),
    (2, 4, 6, 3, 2, 1, 1, 1, 2),
    (1, 3, 5, 4, 3, 0, 2, 1, 1),
    (2, 6, 6, 3, 2, 2, 1, 2, 3),
    (3, 2, 4, 3, 2, 1, 0, 1, 1),
    # an output padding not below the stride, which a larger dilation allows (wave 37: the input
    # gradient came out output_padding // stride positions too long)
    (1, 6, 4, 3, 2, 0, 2, 3, 1),
    (2, 4, 6, 3, 1, 1, 2, 3, 2),
]


@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_transposed_convolution_backward_matches_native(case: tuple) -> None:
    dims, c_in, c_out, k, stride, padding, out_pad, dilation, groups = case
    torch.manual_seed(0)
    x = torch.randn(2, c_in, *([6] * dims), dtype=torch.float64)
    w = torch.randn(c_in, c_out // groups, *([k] * dims), dtype=torch.float64)
    args = ([stride] * dims, [padding] * dims, [dilation] * dims)
    y = aten.convolution(x, w, None, *args, True, [out_pad] * dims, groups)
    g = torch.randn_like(y)
    mask = [True, True, True]
    want = aten.convolution_backward(g, x, w, [c_out], *args, True, [out_pad] * dims, groups, mask)
    got = convolution_backward(g, x, w, [c_out], *args, True, [out_pad] * dims, groups, mask)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


# ---- pooling ------------------------------------------------------------------------------------

AVG_POOL_CASES = [
    # (input size, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    ((9, 9), (3, 3), (1, 1), (1, 1), True, False, 2),
    ((9, 9), (4, 4), (2, 3), (1, 1), True, False, None),
    ((9, 9), (6, 6), (3, 3), (2, 3), True, True, None),
    ((4, 4), (2, 2), (2, 2), (0, 0), False, True, -2),
    ((7, 10), (3, 2), (2, 2), (1, 0), True, True, None),
    ((7, 10), (3, 2), (2, 2), (1, 0), False, False, None),
    ((5, 6, 7), (2, 3, 2), (2, 1, 2), (1, 1, 0), True, False, None),
]


@pytest.mark.parametrize("case", AVG_POOL_CASES)
def test_avg_pool_and_backward_match_native(case: tuple) -> None:
    size, kernel, stride, padding, ceil_mode, include_pad, divisor = case
    spatial = len(size)
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    args = (list(kernel), list(stride), list(padding), ceil_mode, include_pad, divisor)
    native, native_backward = (
        (aten.avg_pool2d, aten.avg_pool2d_backward)
        if spatial == 2
        else (aten.avg_pool3d, aten.avg_pool3d_backward)
    )
    want = native(x, *args)
    torch.testing.assert_close(pooling.avg_pool(x, *args, spatial=spatial), want)
    g = torch.randn_like(want)
    torch.testing.assert_close(
        pooling.avg_pool_backward(g, x, *args, spatial=spatial), native_backward(g, x, *args)
    )


@pytest.mark.parametrize(
    ("size", "out"), [((8, 8), (3, 5)), ((7, 10), (5, 7)), ((6, 6), (2, 3)), ((5, 5), (1, 1))]
)
def test_adaptive_max_pool2d_and_backward_match_native(size: tuple[int, int], out: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    values, indices = pooling.adaptive_max_pool2d(x, list(out))
    want_values, want_indices = aten.adaptive_max_pool2d(x, list(out))
    torch.testing.assert_close(values, want_values)
    assert torch.equal(indices, want_indices)
    g = torch.randn_like(values)
    torch.testing.assert_close(
        pooling.adaptive_max_pool2d_backward(g, x, indices),
        aten.adaptive_max_pool2d_backward(g, x, want_indices),
    )


# ---- elementwise and distances --------------------------------------------------------------------


def test_hypot_erfinv_cumprod_match_native() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(50) * 5, torch.randn(50) * 5
    torch.testing.assert_close(math_ops.hypot(a, b), torch.hypot(a, b))
    # wave 35: sqrt(a² + b²) overflowed from 1.9e19 and underflowed below 1e-23
    edges = [0.0, -0.0, 3.0, -4.0, 1e20, -3e38, 1e-30, -1e-40, math.inf, -math.inf, math.nan]
    a, b = (torch.tensor(v) for v in zip(*itertools.product(edges, edges), strict=True))
    torch.testing.assert_close(math_ops.hypot(a, b), torch.hypot(a, b), equal_nan=True, rtol=1e-6, atol=0)
    y = torch.cat([torch.rand(2000) * 2 - 1, torch.tensor([0.0, 1.0, -1.0, 1.5, -2.0, 0.999999, -0.9999999])])
    torch.testing.assert_close(math_ops.erfinv(y), torch.erfinv(y), equal_nan=True, rtol=2e-6, atol=1e-6)
    x = torch.randn(3, 6, 4)
    x[1, 2, 0] = 0.0  # zeros and signs: exp(cumsum(log)) would get these wrong
    for dim in (0, 1, -1):
        torch.testing.assert_close(math_ops.cumprod(x, dim), torch.cumprod(x, dim))
    torch.testing.assert_close(
        math_ops.cumprod(x, 1, torch.float64), torch.cumprod(x, 1, dtype=torch.float64)
    )


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, math.inf])
def test_cdist_forward_and_backward_match_native(p: float) -> None:
    torch.manual_seed(0)
    x1 = torch.randn(2, 5, 3, dtype=torch.float64)
    x2 = torch.randn(2, 4, 3, dtype=torch.float64)
    x2[0, 0] = x1[0, 0]  # a zero distance
    want = aten._cdist_forward(x1, x2, p, None)
    torch.testing.assert_close(math_ops.cdist_forward(x1, x2, p, None), want)
    g = torch.randn_like(want)
    torch.testing.assert_close(
        math_ops.cdist_backward(g, x1, x2, p, want), aten._cdist_backward(g, x1, x2, p, want)
    )


def test_bool_reductions_and_amax_without_dim_match_native() -> None:
    mask = torch.tensor([[False, True, True], [False, False, False]])
    values, indices = math_ops.max_dim(mask, 1)
    want_values, want_indices = torch.max(mask, 1)
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)
    assert torch.equal(math_ops.argmax(mask, 1), torch.argmax(mask.to(torch.uint8), 1))
    assert math_ops.max_dim(torch.randn(2, 3), 1) is NotImplemented
    x = torch.randn(3, 4)
    torch.testing.assert_close(math_ops.amax(x), torch.amax(x))
    torch.testing.assert_close(math_ops.amin(torch.tensor(2.5), [0]), torch.amin(torch.tensor(2.5), [0]))


# ---- embedding_bag --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize(("weighted", "padding_idx", "last_offset"), [(False, -1, False), (True, 1, True)])
def test_embedding_bag_forward_and_backward_match_native(
    mode: int, weighted: bool, padding_idx: int, last_offset: bool
) -> None:
    if weighted and mode != 0:
        pytest.skip("per-sample weights exist for mode sum only")
    torch.manual_seed(0)
    weight = torch.randn(10, 4, dtype=torch.float64)
    indices = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 1])
    offsets = torch.tensor([0, 3, 3, 7, 10]) if last_offset else torch.tensor([0, 3, 3, 7])  # bag 1 is empty
    psw = torch.rand(10, dtype=torch.float64) if weighted else None
    args = (weight, indices, offsets, False, mode, False, psw, last_offset, padding_idx)
    got = embedding.embedding_bag(*args)
    want = aten._embedding_bag(*args)
    torch.testing.assert_close(got[0], want[0])
    grad = torch.randn_like(want[0])
    native_grad = aten._embedding_bag_dense_backward(
        grad, indices, want[1], want[2], want[3], 10, False, mode, psw, padding_idx
    )
    mine = embedding.embedding_bag_dense_backward(
        grad, indices, got[1], got[2], got[3], 10, False, mode, psw, padding_idx
    )
    torch.testing.assert_close(mine, native_grad)
    if weighted:
        torch.testing.assert_close(
            embedding.embedding_bag_per_sample_weights_backward(
                grad, weight, indices, offsets, got[1], mode, padding_idx
            ),
            aten._embedding_bag_per_sample_weights_backward(
                grad, weight, indices, offsets, want[1], mode, padding_idx
            ),
        )


@pytest.mark.parametrize("mode", [0, 2])
def test_embedding_bag_memory_grows_with_the_indices_not_indices_times_bags(mode: int) -> None:
    # Wave 49's review: an [indices x bags] mask (and [bags x indices x dim] candidates for max):
    # 4 GiB and 12 s a step at a thousand bags of ten. Every tensor the decomposition makes now
    # holds at most one row per index or per bag.
    from torch.fx.experimental.proxy_tensor import make_fx

    bags, per_bag, dim = 64, 10, 4
    weight = torch.randn(100, dim)
    indices = torch.randint(0, 100, (bags * per_bag,))
    offsets = torch.arange(0, bags * per_bag, per_bag)
    args = (weight, indices, offsets, False, mode, False, None, False, -1)
    graph = make_fx(embedding.embedding_bag)(*args)
    largest = max(
        n.meta["val"].numel() for n in graph.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
    )
    assert largest <= (bags * per_bag + 1) * dim, largest
    torch.testing.assert_close(graph(*args)[0], aten._embedding_bag(*args)[0])


def test_embedding_bag_scale_grad_by_freq_is_refused_not_approximated() -> None:
    grad, indices = torch.randn(2, 3), torch.tensor([1, 1, 2, 5, 1])
    offset2bag, bag_size = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 3])
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq"):
        embedding.embedding_bag_dense_backward(
            grad, indices, offset2bag, bag_size, bag_size, 6, True, 1, None
        )


# ---- 0-d scatters and gathers --------------------------------------------------------------------


def test_scalar_scatter_and_gather_run_on_one_element() -> None:
    table = indexing.scalar_indexing_table()
    x, src, index = torch.tensor(1.5), torch.tensor(4.0), torch.tensor(0)
    assert torch.equal(table[aten.scatter.src](x, 0, index, src), aten.scatter.src(x, 0, index, src))
    assert torch.equal(table[aten.gather.default](x, 0, index), aten.gather(x, 0, index))
    assert table[aten.gather.default](torch.randn(3), 0, torch.tensor([1])) is NotImplemented
    # A 1-d index over a 0-d tensor (wave 37: the gather came back 0-d) and a 1-d scatter.
    for shape in ((1,), (3,), (0,)):
        ones = torch.zeros(shape, dtype=torch.long)
        assert torch.equal(table[aten.gather.default](x, 0, ones), aten.gather(x, 0, ones))
        values = torch.arange(float(ones.numel()))
        got = table[aten.scatter_add.default](x, 0, ones, values)
        assert torch.equal(got, aten.scatter_add(x, 0, ones, values))


# ---- losses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_binary_cross_entropy_with_logits_matches_native_in_float32(weighted: bool, reduction: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5) * 9  # large logits: where log(sigmoid) loses precision
    y = torch.rand(4, 5)
    weight = torch.rand(5) if weighted else None
    pos_weight = torch.rand(5) + 0.5 if weighted else None
    got = losses.binary_cross_entropy_with_logits(x, y, weight, pos_weight, reduction)
    want = aten.binary_cross_entropy_with_logits(x, y, weight, pos_weight, reduction)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_regression_loss_backwards_round_as_the_kernels(dtype: torch.dtype, reduction: int) -> None:
    """Bit for bit in half precision (wave 37: mse_loss_backward computed in float32 and rounded
    once, where PyTorch's kernel rounds each operation and the 2 / n scale; a bfloat16 regression
    head's weight gradient came out 5 % off eager's)."""
    torch.manual_seed(0)
    n = 4096
    x, target = (torch.randn(n) * 2).to(dtype), (torch.randn(n) * 2).to(dtype)
    grad = torch.randn(n).to(dtype) if reduction == 0 else torch.randn(()).to(dtype)
    cases = [
        (losses.mse_loss_backward, aten.mse_loss_backward, ()),
        (losses.huber_loss_backward, aten.huber_loss_backward, (1.0,)),
        (losses.smooth_l1_loss_backward, aten.smooth_l1_loss_backward, (1.0,)),
    ]
    for ours, kernel, extra in cases:
        got, want = ours(grad, x, target, reduction, *extra), kernel(grad, x, target, reduction, *extra)
        if dtype == torch.float32:  # the last bit may differ there (PyTorch's vectorized order)
            torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-12)
        else:
            assert torch.equal(got, want), f"{kernel}: {(got != want).sum()} of {n} differ"


def test_median_is_nan_at_the_first_nan_as_native() -> None:
    """Wave 37: the k-th smallest alone gave a number for a row holding a NaN."""
    nan = float("nan")
    x = torch.tensor(
        [[1.0, nan, 3.0, 2.0, nan], [0.0, 3.0, 1.0, 0.0, 5.0], [nan] * 5, [5.0, 1.0, nan, 2.0, 4.0]]
    )
    for dim, keepdim in ((1, False), (0, True)):
        for got, want in zip(
            math_ops.median_dim(x, dim, keepdim), torch.median(x, dim, keepdim), strict=True
        ):
            torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(math_ops.median(x), torch.median(x), equal_nan=True)
    torch.testing.assert_close(math_ops.median(x[1]), torch.median(x[1]))


def test_kthvalue_and_mode_match_native() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 7)
    for dim, keepdim in ((1, False), (0, True)):
        for got, want in zip(
            math_ops.kthvalue(x, 3, dim, keepdim), torch.kthvalue(x, 3, dim, keepdim), strict=True
        ):
            torch.testing.assert_close(got, want)
    ties = torch.tensor([[3.0, 1.0, 3.0, 1.0, 2.0, 1.0, 3.0], [2.0, 5.0, 2.0, 5.0, 7.0, 0.0, 0.0]])
    for data in (ties, torch.randint(0, 3, (5, 6)).float()):
        for dim, keepdim in ((1, False), (0, True)):
            for got, want in zip(
                math_ops.mode(data, dim, keepdim), torch.mode(data, dim, keepdim), strict=True
            ):
                torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("ours", "native"),
    [
        (special.erfc, torch.erfc),
        (special.erfcx, torch.special.erfcx),
        (special.log_ndtr, torch.special.log_ndtr),
    ],
)
def test_erfc_family_keeps_its_tails_in_float32(ours, native) -> None:  # type: ignore[no-untyped-def]
    # onnxscript's 1 - Erf(x) is 0 above x ~ 3.9, so log_ndtr came out -inf: compare with a
    # float64 truth wherever float32 can hold the value, as closely as PyTorch's float32 kernel.
    x = torch.linspace(-12.0, 30.0, 20001, dtype=torch.float64)
    truth, got, eager = native(x), ours(x.float()).double(), native(x.float()).double()
    assert torch.equal(torch.isfinite(got), torch.isfinite(eager))
    normal = torch.isfinite(eager) & (eager.abs() > 1e-30)
    relative = ((got - truth).abs() / truth.abs())[normal]
    eager_relative = ((eager - truth).abs() / truth.abs())[normal]
    assert relative.max() < 2 * eager_relative.max() + 1e-6


def test_gamma_family_matches_native_as_closely_as_float32_does() -> None:
    # Both sides of the reflection at 1/2, large arguments, and away from the poles.
    x = torch.linspace(-9.7, 40.0, 8001, dtype=torch.float64)
    x = x[(x - x.round()).abs() > 1e-3]
    pairs = [(special.lgamma, torch.lgamma), (special.digamma, torch.digamma)]
    pairs += [
        (lambda t, n=n: special.polygamma(n, t), lambda t, n=n: torch.polygamma(n, t)) for n in (1, 2, 4)
    ]
    for ours, native in pairs:
        truth, got, eager = native(x), ours(x.float()).double(), native(x.float()).double()
        error = ((got - truth).abs() / (truth.abs() + 1)).max()
        eager_error = ((eager - truth).abs() / (truth.abs() + 1)).max()
        assert error <= 1.5 * eager_error + 1e-5
    poles = torch.tensor([0.0, -0.0, -1.0, -3.0])  # digamma(-0.0) is +inf (wave 53: was -inf)
    torch.testing.assert_close(special.digamma(poles), torch.digamma(poles), equal_nan=True)
    torch.testing.assert_close(special.lgamma(poles), torch.lgamma(poles))
    torch.testing.assert_close(special.polygamma(2, poles), torch.polygamma(2, poles))
    y = torch.tensor([1.3, 2.0, 7.5])
    torch.testing.assert_close(special.mvlgamma(y, 3), torch.mvlgamma(y, 3))
    # At and below (p - 1) / 2 PyTorch computes the sum too (wave 53: it was NaN here): inf at 1.0
    low = torch.tensor([0.9, 1.0, 0.5])
    torch.testing.assert_close(special.mvlgamma(low, 3), torch.mvlgamma(low, 3))
    torch.testing.assert_close(special.mvlgamma(low, 2), torch.mvlgamma(low, 2))


def test_polygamma_at_negative_half_integers_keeps_float32_precision() -> None:
    """The reflection's cot(πx) is 0 there; ``1 / tan(π/2)`` gave -4.4e-8 in float32, and
    polygamma(2, -10.5), 0.008 in size, came out 3.3e-4 relative off (wave 44)."""
    x = -torch.arange(0.5, 12.0, 1.0, dtype=torch.float64)
    for n in (1, 2, 3):
        truth, got = torch.polygamma(n, x), special.polygamma(n, x.float()).double()
        eager = torch.polygamma(n, x.float()).double()
        relative = ((got - truth).abs() / truth.abs()).max()
        assert relative <= 4 * ((eager - truth).abs() / truth.abs()).max() + 1e-6, (n, relative)


def test_nan_aware_extremes_copysign_and_running_extremes_match_native() -> None:
    a = torch.tensor([1.0, math.nan, -2.0, math.nan, 0.0, -0.0])
    b = torch.tensor([math.nan, 3.0, -1.0, math.nan, -0.0, 2.0])
    torch.testing.assert_close(math_ops.fmax(a, b), torch.fmax(a, b), equal_nan=True)
    torch.testing.assert_close(math_ops.fmin(a, b), torch.fmin(a, b), equal_nan=True)
    signs = math_ops.copysign(torch.tensor([1.0, -2.0, 3.0, 4.0]), torch.tensor([-0.0, 0.0, -5.0, 1.0]))
    assert torch.equal(
        signs, torch.copysign(torch.tensor([1.0, -2.0, 3.0, 4.0]), torch.tensor([-0.0, 0.0, -5.0, 1.0]))
    )
    torch.testing.assert_close(
        math_ops.copysign(torch.tensor([2, -3]), -1.5), torch.copysign(torch.tensor([2, -3]), -1.5)
    )
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 5.0, 5.0, 1.0], [0.0, -1.0, -1.0, 4.0, 4.0, -2.0, -2.0]])
    # NaN: the running extreme is NaN from the first one on, at the last NaN so far (wave 41: -1).
    nans = torch.tensor(
        [[1.0, math.nan, 3.0, math.nan, 0.5, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, math.nan]]
    )
    for data in (ties, nans, torch.randn(3, 5, 4)):
        for dim in range(data.dim()):
            for ours, native in ((math_ops.cummax, torch.cummax), (math_ops.cummin, torch.cummin)):
                for got, want in zip(ours(data, dim), native(data, dim), strict=True):
                    torch.testing.assert_close(got, want, equal_nan=True)
        for got, want in zip(
            math_ops.aminmax(data, dim=1, keepdim=True), torch.aminmax(data, dim=1, keepdim=True), strict=True
        ):
            torch.testing.assert_close(got, want, equal_nan=True)
        torch.testing.assert_close(math_ops.median(data), torch.median(data), equal_nan=True)
    x = torch.randn(5, 6)
    for dim, keepdim in ((1, False), (0, True)):
        for got, want in zip(
            math_ops.median_dim(x, dim, keepdim), torch.median(x, dim, keepdim), strict=True
        ):
            torch.testing.assert_close(got, want)
    g, z = torch.randn(50), torch.linspace(-30, 30, 50)
    torch.testing.assert_close(math_ops.mish_backward(g, z), aten.mish_backward(g, z))


@pytest.mark.parametrize("padding", [(2, 1), (1, 3, 0, 2), (-1, 2, 1, -2), (1, 0, 2, 1, 1, 2)])
def test_replication_pad_and_backward_match_native(padding: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    spatial = len(padding) // 2
    x = torch.randn([2, 3, 5, 6, 4][: 2 + spatial])
    want = torch.nn.functional.pad(x, padding, mode="replicate")
    torch.testing.assert_close(pooling.replication_pad(x, padding), want)
    grad = torch.randn_like(want)
    native = getattr(aten, f"replication_pad{spatial}d_backward")(grad, x, padding)
    torch.testing.assert_close(pooling.replication_pad_backward(grad, x, padding), native)


def test_pool3d_decompositions_match_native() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 5, 6)
    for out in ((3, 2, 4), (7, 5, 6), (1, 1, 1)):
        torch.testing.assert_close(pooling.adaptive_avg_pool3d(x, out), aten._adaptive_avg_pool3d(x, out))
        grad = torch.randn([2, 3, *out])
        torch.testing.assert_close(
            pooling.adaptive_avg_pool3d_backward(grad, x), aten._adaptive_avg_pool3d_backward(grad, x)
        )
        values, indices = aten.adaptive_max_pool3d(x, out)
        torch.testing.assert_close(
            pooling.adaptive_max_pool3d_backward(grad, x, indices),
            aten.adaptive_max_pool3d_backward(grad, x, indices),
        )
    args = ([3, 2, 3], [2, 1, 2], [1, 0, 1], [1, 1, 1], True)
    values, indices = aten.max_pool3d_with_indices(x, *args)
    grad = torch.randn_like(values)
    torch.testing.assert_close(
        pooling.max_pool3d_with_indices_backward(grad, x, *args, indices),
        aten.max_pool3d_with_indices_backward(grad, x, *args, indices),
    )


def test_gathers_scatters_and_trilinear_match_native() -> None:

    torch.manual_seed(0)
    x, src = torch.randn(4, 5), torch.randn(4, 7)
    index = torch.tensor([[0, 1, 1, 4, 0, 2, 2]] * 4)
    for include_self in (True, False):
        want = x.scatter_reduce(1, index, src, "mean", include_self=include_self)
        torch.testing.assert_close(
            gathers.scatter_reduce_mean(x, 1, index, src, "mean", include_self=include_self), want
        )
        xi = torch.arange(20).reshape(4, 5)
        want_int = xi.scatter_reduce(
            1, index, torch.arange(28).reshape(4, 7), "mean", include_self=include_self
        )
        got_int = gathers.scatter_reduce_mean(
            xi, 1, index, torch.arange(28).reshape(4, 7), "mean", include_self=include_self
        )
        torch.testing.assert_close(got_int, want_int)
        for reduce in ("mean", "prod", "amax", "amin"):
            rows = torch.tensor([0, 3, 3, 1, 0, 2, 0])
            want = x.index_reduce(1, rows[:5], src[:, :5], reduce, include_self=include_self)
            got = gathers.index_reduce(x, 1, rows[:5], src[:, :5], reduce, include_self=include_self)
            torch.testing.assert_close(got, want)
    flat_index = torch.tensor([[0, -1], [7, 19]])
    torch.testing.assert_close(gathers.take(x, flat_index), torch.take(x, flat_index))
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    for accumulate in (True, False):
        torch.testing.assert_close(
            gathers.put(x, torch.tensor([[0, -1], [7, 7]]) if accumulate else flat_index, values, accumulate),
            x.put(torch.tensor([[0, -1], [7, 7]]) if accumulate else flat_index, values, accumulate),
        )
    bilinear = torch.nn.Bilinear(3, 5, 6)
    a, b = torch.randn(4, 3), torch.randn(4, 5)
    args = ([1, 3], [0], [1, 2], [2, 3])  # as torch.nn.functional.bilinear calls it
    want = aten._trilinear(a, bilinear.weight, b, *args)
    torch.testing.assert_close(math_ops.trilinear(a, bilinear.weight, b, *args), want)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_ctc_loss_and_its_gradient_match_native(reduction: str) -> None:
    from ortrain.capture.decompositions_ctc import ctc_loss_function

    torch.manual_seed(0)
    logits = torch.randn(12, 4, 5, requires_grad=True)
    targets = torch.randint(1, 5, (4, 4))
    targets[0, 1] = targets[0, 0]
    input_lengths, target_lengths = [12, 10, 7, 2], [4, 3, 2, 3]  # the last cannot align
    flat = torch.cat([row[:n] for row, n in zip(targets, target_lengths, strict=True)])
    for labels, lengths in ((targets, (torch.tensor(input_lengths), torch.tensor(target_lengths))),
                            (flat, (input_lengths, target_lengths))):  # fmt: skip
        for source in (logits, logits.log_softmax(-1)):  # PyTorch's gradient for log_probs as given
            want = torch.nn.functional.ctc_loss(
                source, labels, *lengths, reduction=reduction, zero_infinity=True
            )
            got = ctc_loss_function(source, labels, *lengths, reduction=reduction, zero_infinity=True)
            torch.testing.assert_close(got, want)
            weight = torch.linspace(0.5, 1.5, want.numel()).reshape(want.shape)
            (want_grad,) = torch.autograd.grad((want * weight).sum(), logits, retain_graph=True)
            (got_grad,) = torch.autograd.grad((got * weight).sum(), logits, retain_graph=True)
            torch.testing.assert_close(got_grad, want_grad)


def test_frexp_matches_native_bit_for_bit() -> None:
    torch.manual_seed(0)
    special_values = [0.0, -0.0, 1.0, 2.0, 0.5, -4.0, 1e-40, -3e-45, 3.4e38, math.inf, -math.inf, math.nan]
    x = torch.cat([torch.randn(1000) * 1e3, torch.tensor([*special_values, 0.9999999, 1.0000001, 2.0**-126])])
    mantissa, exponent = math_ops.frexp(x)
    want_mantissa, want_exponent = torch.frexp(x)
    assert torch.equal(exponent, want_exponent)
    torch.testing.assert_close(mantissa, want_mantissa, rtol=0, atol=0, equal_nan=True)


def test_nanmedian_matches_native() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 7)
    x[0, 2] = math.nan
    x[2, [1, 3, 5]] = math.nan
    for dim, keepdim in ((1, False), (0, True)):
        got, want = math_ops.nanmedian_dim(x, dim, keepdim), torch.nanmedian(x, dim, keepdim)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, equal_nan=True)
    torch.testing.assert_close(math_ops.nanmedian(x), torch.nanmedian(x))
    x[1, :] = math.nan  # an all-NaN row: NaN (its index is unspecified)
    assert math_ops.nanmedian_dim(x, 1)[0][1].isnan()


def test_integer_relu_matches_native_and_floats_are_left_alone() -> None:
    x = torch.tensor([-3, 0, 5], dtype=torch.int64)
    assert torch.equal(math_ops.relu(x), torch.relu(x))
    assert math_ops.relu(torch.randn(3)) is NotImplemented


@pytest.mark.parametrize(
    ("ours", "native"),
    [
        (bessel.i0, torch.i0),
        (bessel.special_i0e, torch.special.i0e),
        (bessel.special_i1, torch.special.i1),
        (bessel.special_i1e, torch.special.i1e),
    ],
)
def test_bessel_functions_match_native_as_closely_as_float32_does(ours, native) -> None:  # type: ignore[no-untyped-def]
    """Both Chebyshev branches (|x| <= 8 and beyond, up to float32's overflow of I(x)), the
    branch point, 0, ±inf and NaN; in float64 to 1e-14, in float32 within 2x eager's error."""
    x = torch.cat([torch.linspace(-95, 95, 3801, dtype=torch.float64), torch.tensor([0.0, 8.0, -8.0, 1e-30])])
    reference = native(x)
    torch.testing.assert_close(ours(x), reference, rtol=1e-14, atol=0)
    special_values = torch.tensor([math.inf, -math.inf, math.nan])
    torch.testing.assert_close(ours(special_values), native(special_values), equal_nan=True)
    finite = torch.isfinite(native(x.float()))
    scale = reference.abs()[finite].clamp_min(1e-30)  # i1(0) = 0
    got_error = ((ours(x.float()).double() - reference)[finite].abs() / scale).max()
    eager_error = ((native(x.float()).double() - reference)[finite].abs() / scale).max()
    assert got_error <= 2 * eager_error + 1e-7


def test_ndtri_matches_native_in_the_centre_and_both_tails() -> None:
    y = torch.cat(
        [
            torch.linspace(0, 1, 2001, dtype=torch.float64),
            torch.logspace(-300, -1, 300, dtype=torch.float64),
            1 - torch.logspace(-15, -1, 50, dtype=torch.float64),
            torch.tensor([-0.5, 1.5, math.nan], dtype=torch.float64),
        ]
    )
    torch.testing.assert_close(
        special.ndtri(y), torch.special.ndtri(y), rtol=1e-14, atol=1e-14, equal_nan=True
    )
    tails = torch.cat([torch.logspace(-38, -1, 100), torch.rand(1000)])  # float32
    reference = torch.special.ndtri(tails.double())
    got_error = (special.ndtri(tails).double() - reference).abs().max()
    assert got_error <= 2 * (torch.special.ndtri(tails).double() - reference).abs().max()


def test_nextafter_matches_native_bit_for_bit() -> None:
    for dtype, bits in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        info = torch.finfo(dtype)
        edges = [0.0, -0.0, 1.0, -1.0, 0.5, info.tiny, -info.tiny, info.tiny * info.eps, info.max,
                 -info.max, math.inf, -math.inf, math.nan, 3.0]  # fmt: skip
        torch.manual_seed(0)
        values = torch.cat(
            [torch.tensor(edges, dtype=dtype), torch.randn(200, dtype=dtype) * 1e30 ** torch.randn(200)]
        )
        x = values.repeat_interleave(len(edges))
        y = torch.tensor(edges, dtype=dtype).repeat(len(values))
        got, want = math_ops.nextafter(x, y), torch.nextafter(x, y)
        same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
        assert same.all(), (x[~same][:4], y[~same][:4], got[~same][:4], want[~same][:4])


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 0.5, 3.0, math.inf])
def test_pdist_and_masked_scatter_backward_match_native(p: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    distances = torch.pdist(x, p)
    grad = torch.randn_like(distances)
    (want,) = torch.autograd.grad(distances, x, grad)
    torch.testing.assert_close(math_ops.pdist_forward(x.detach(), p), distances.detach())
    torch.testing.assert_close(math_ops.pdist_backward(grad, x.detach(), p, distances.detach()), want)
    assert math_ops.pdist_forward(x[:1].detach(), p).shape == (0,)
    source = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1) > 0.4
    out = torch.randn(2, 4, dtype=torch.float64).masked_scatter(mask, source)
    grad_out = torch.randn_like(out)
    (want,) = torch.autograd.grad(out, source, grad_out)
    assert torch.equal(gathers.masked_scatter_backward(grad_out, mask, [3, 4]), want)


def test_unfold_and_its_backward_on_an_empty_batch_are_zeros_of_the_right_shape() -> None:
    x = torch.randn(0, 2, 5, 6)
    args = ([2, 3], [1, 2], [1, 0], [2, 1])  # kernel, dilation, padding, stride
    columns = aten.im2col(x, *args)
    assert pooling.im2col(x, *args).shape == columns.shape == (0, 12, 6)
    assert pooling.col2im(columns, [5, 6], *args).shape == aten.col2im(columns, [5, 6], *args).shape
    assert pooling.im2col(torch.randn(1, 2, 5, 6), *args) is NotImplemented


@pytest.mark.parametrize(("shape", "dim"), [((6, 3, 5), 0), ((6, 3, 5), 2), ((4, 7), 0), ((4, 7), 1)])
def test_weight_norm_backward_matches_native(shape: tuple[int, ...], dim: int) -> None:
    torch.manual_seed(0)
    v = torch.randn(shape, dtype=torch.float64)
    g = torch.randn([n if d == dim else 1 for d, n in enumerate(shape)], dtype=torch.float64)
    w, norms = aten._weight_norm_interface(v, g, dim)
    grad_w = torch.randn_like(w)
    want = aten._weight_norm_interface_backward(grad_w, v, g, norms, dim)
    got = math_ops.weight_norm_interface_backward(grad_w, v, g, norms, dim)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_truth_over_no_dimensions_keeps_pytorchs_dtypes() -> None:
    """``any``/``all`` with ``dim=()``: each element's truth, bool, or uint8 for a uint8 input."""
    for x in (
        torch.tensor([[0, 2], [1, 0]], dtype=torch.uint8),
        torch.tensor([[True, False]]),
        torch.tensor([[0.0, -0.5]]),
        torch.tensor([[0, 3]]),
    ):
        for op in (torch.any, torch.all):
            got, expected = math_ops.truth_over_no_dimensions(x, ()), op(x, dim=())
            assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool])
def test_running_extremes_of_integers_and_booleans_match_native(dtype: torch.dtype) -> None:
    """Wave 48's review: masked positions held ±inf, an int tensor's least value either way
    (cummin of int64 gave -2**63) and a bool's True."""
    x = torch.tensor([[7, 9, 3, 5, 1, 4], [0, 2, 2, 1, 6, 0]]).to(dtype)
    if dtype == torch.int8:
        x = x - 4
    for ours, native in ((math_ops.cummax, torch.cummax), (math_ops.cummin, torch.cummin)):
        for dim in (0, 1):
            got, expected = ours(x, dim), native(x, dim)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (ours, dim)
    empty = torch.empty(3, 0)
    assert math_ops.cummax(empty, 1)[0].shape == torch.cummax(empty, 1)[0].shape == (3, 0)


def test_copysign_of_numbers_integers_and_booleans_matches_native() -> None:
    cases = [
        (torch.tensor([-5, 3, 2], dtype=torch.int8), torch.tensor([1, -1, 1], dtype=torch.int8)),
        (torch.tensor([True, False]), torch.tensor([-1.0, 2.0])),
        (torch.randn(3), -0.0),
        (torch.tensor([1, -2]), 2.5),
        (torch.randn(3, dtype=torch.float16), torch.randn(3)),
    ]
    for a, b in cases:
        got, expected = math_ops.copysign(a, b), torch.copysign(a, b)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_fft_sample_frequencies_match_native_bit_for_bit() -> None:
    for n, d, dtype in itertools.product((1, 2, 5, 8, 9), (1.0, 0.1, 1 / 3), (None, torch.float64)):
        assert torch.equal(math_ops.fftfreq(n, d, dtype=dtype), torch.fft.fftfreq(n, d, dtype=dtype))
        assert torch.equal(math_ops.rfftfreq(n, d, dtype=dtype), torch.fft.rfftfreq(n, d, dtype=dtype))


class _ShuffledWeight(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...], factor: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(shape))
        self.factor = factor

    def forward(self) -> torch.Tensor:
        return torch.nn.functional.pixel_shuffle(self.weight, self.factor)


@pytest.mark.parametrize("shape", [(1, 0, 1, 1), (2, 0, 3, 3), (3, 2, 4, 3, 3)], ids=str)
def test_pixel_shuffle_and_its_backward_train_like_eager_on_empty_tensors(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward is a pixel_unshuffle, which onnxscript reshaped with a -1: refused by ONNX
    Runtime on an empty tensor. (PyTorch's own backward fails on an empty tensor for a factor
    above 1: the factor is 1 where the tensor is empty.)"""
    import copy

    from ortrain import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # ONNX Runtime runs them
    eager = _ShuffledWeight(shape, 2 if math.prod(shape) else 1)
    wrapped = ORTModule(copy.deepcopy(eager))
    expected, got = eager(), wrapped()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)
    scale = torch.arange(float(expected.numel())).view(expected.shape)
    (expected * scale).sum().backward()
    (got * scale).sum().backward()
    torch.testing.assert_close(wrapped.module.weight.grad, eager.weight.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_dropout_backward_is_eagers_cpu_gradient(dtype: torch.dtype) -> None:
    """``native_dropout_backward`` multiplies by the unrounded ``1 / (1 - p)``; eager's CPU
    dropout's gradient is ``grad * noise``, the noise rounded to the dtype (wave 54: one bfloat16
    unit off under autocast). Every rate in steps of 0.005, and gradients that are inf, NaN, -0."""
    from ortrain.capture.decompositions_dropout import native_dropout_backward

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, generator=gen, dtype=torch.float64).to(dtype)
    grad = torch.randn(512, generator=gen, dtype=torch.float64).to(dtype)
    grad[:3] = torch.tensor([math.inf, math.nan, -0.0], dtype=dtype)
    for p in [i / 200 for i in range(1, 200)] + [1 / 3, 0.123]:
        torch.manual_seed(1)
        leaf = x.clone().requires_grad_()
        F.dropout(leaf, p, training=True).backward(grad)
        torch.manual_seed(1)
        _, mask = aten.native_dropout(x, p, True)
        got = native_dropout_backward(grad, mask, 1.0 / (1.0 - p))
        assert leaf.grad is not None
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=0, equal_nan=True, msg=f"p={p}")
        assert torch.equal(got.signbit(), leaf.grad.signbit()), p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case",
    [
        ((1, 2300), (1, 3), (1, 1), (0, 0), False, True, None),
        ((20, 20), (17, 17), (1, 1), (0, 0), False, True, None),
        ((9, 9), (6, 6), (3, 3), (2, 3), True, True, None),
        ((7, 10), (3, 2), (2, 2), (1, 0), False, False, None),
    ],
)
def test_half_precision_avg_pool_and_backward_match_native_bit_for_bit(
    case: tuple, dtype: torch.dtype
) -> None:
    # Divisors are exact integers past 256/2048 and 17 * 17; sums and the backward's adds round
    # where eager's CPU kernels round (forward in float32 once, backward in half per window).
    size, kernel, stride, padding, ceil_mode, include_pad, divisor = case
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size).to(dtype)
    args = (list(kernel), list(stride), list(padding), ceil_mode, include_pad, divisor)
    want = aten.avg_pool2d(x, *args)
    assert torch.equal(pooling.avg_pool(x, *args, spatial=2), want)
    g = torch.randn_like(want)
    assert torch.equal(
        pooling.avg_pool_backward(g, x, *args, spatial=2), aten.avg_pool2d_backward(g, x, *args)
    )
