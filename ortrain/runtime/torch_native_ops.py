"""Operators that PyTorch runs by design: ONNX has no equivalent for them.

The partitioner gives these nodes to the torch executor under every fallback policy,
``FALLBACK_DISABLE`` included: they are not refusals (nothing warns, nothing counts as a
fallback), and each graph names them in one INFO line. The rest of the graph stays in ONNX
Runtime. An operator that merely lacks a translation today is *not* listed here: that is a gap
to fill (a decomposition or a translation), and ``FALLBACK_DISABLE`` still reports it.

Ten kinds of nodes are PyTorch's:

- **Matrix factorizations and what is built on them**: ONNX has ``Det`` and nothing else of
  linear algebra beyond products (no LU, QR, Cholesky, SVD, eigen-decomposition, triangular or
  general solve, inverse). Writing them as loops of ONNX ops would be a slow, numerically weaker
  copy of LAPACK; their gradients are AOTAutograd's formulas, made of these same ops and matrix
  products, so they stay exact. ``_linalg_check_errors`` (the check that raises on a singular
  matrix, wrapped by ``with_effects``) goes with them. ``_linalg_det`` is listed although ONNX has
  ``Det``: the op also returns the LU factors its backward reads.
- **Complex tensors**: ONNX Runtime has no complex arithmetic. onnxscript models a complex tensor
  as a real one with a trailing dimension of 2, which holds only while every reader is in ONNX
  (values crossing to PyTorch had the wrong shape), and several complex ops have no translation
  (``slice_scatter`` in the backward of ``irfft``). Any node that reads or writes a complex
  tensor (the FFTs of complex data, ``view_as_complex``, ``stft``'s intermediates) runs in PyTorch.
- **Sparse tensors** (COO, CSR and the other layouts but the strided one): ONNX Runtime's
  sessions take dense tensors. A graph network's ``torch.sparse.mm(adj, h)`` runs in PyTorch
  (``_sparse_addmm`` has no translation), but its backward's ``mm(adj.t(), grad)`` has one, and
  the session was handed the sparse matrix itself: it failed mid-backward from the third step.
  Any node that reads or writes a sparse tensor runs in PyTorch.
- **Strided views of memory laid out otherwise** (``as_strided`` of a tensor that is not
  contiguous from offset 0 where it was traced: a transposed input, LED's chunks of a permuted
  one): ``as_strided`` reads memory, and ONNX Runtime holds every tensor contiguous, so its
  translation picked other elements than PyTorch's kernel (``torch.compile(backend="ortrain")``
  of a model reading its transposed input's strides: losses off by 1e-2, silently). PyTorch runs
  it on the tensor as it comes.
- **Fused attention kernels** (flash / memory-efficient ``scaled_dot_product_attention``, forward
  and backward): the forward returns the log-sum-exp of each row, which its backward reads instead
  of the batch x heads x seq x seq probabilities. Kept whole in PyTorch, attention needs no
  seq x seq tensor in the forward, the stash or the backward, as in eager. The exception: the CPU
  flash kernels on small attention (probabilities under ``FLASH_MIN_PROBABILITY_BYTES`` a call,
  no dropout, one head count for query, key and value) go to ONNX Runtime written out in math
  (:mod:`ortrain.export.flash_attention_math`), where the two crossings a layer would cost more
  than the kernel saves. A graph whose sequence lengths are left open (captured again at a new
  length) keeps the kernel in PyTorch: its next call may be far longer than the one traced, and the
  math form's probabilities grow with the square of the length (wave 49's review: a causal SDPA at
  4096 after captures at 64-96 ran the math form, 1.7-2.2 s and 1.6 GiB a step against the
  kernel's 0.6 s and 430 MiB). (onnxscript's own translation of the forward fills the log-sum-exp with
  zeros, so a backward reading them computes wrong gradients: tiny GPT, errors of 1e4.)

- **Random numbers** (``native_dropout``, ``rand``, ``randn``, ``randint``, ``normal``,
  ``uniform``, ``bernoulli``, ``multinomial``, ...): ONNX Runtime's ``RandomUniformLike`` and
  ``RandomNormalLike`` seed their generator once, when the session is made, so they ignored
  ``torch.manual_seed`` (the same seed drew other numbers at every step and in every process), and
  its CPU ``Bernoulli`` kernel (1.32) returns 1 with probability 1 − p: ``torch.bernoulli`` of 0.8
  averaged 0.2. Drawn by PyTorch, they come from the user's generator with eager's distributions.
  Dropout is drawn by PyTorch too (wave 19): its masks are eager's own under the same seed, and
  they no longer depend on the placement or on the graph that draws them. With ONNX Runtime's
  Dropout (reseeded from PyTorch's generator before each run) the masks depended on both: op
  tuning switches a graph between placements from call to call, so a model run inside
  ``torch.utils.checkpoint.checkpoint`` recomputed its forward with other masks than the forward's
  and trained on wrong gradients (off by 2e-2 where they were 1e-1), and a reentrant checkpoint,
  whose forward runs the no-grad graph and whose recompute the training graph, could not agree
  either. The cost is a crossing between executors at each dropout of a forward graph where ONNX
  Runtime runs the rest (``gpt-dropout``, 9 dropouts: the README's *Dropout in PyTorch*).

- **Grid sampling** (``grid_sampler_2d`` / ``_3d`` and their backward, behind ``F.grid_sample``):
  the backward has no ONNX translation, and the ways around it were not PyTorch's numbers.
  PyTorch's reference decomposition, differentiated, rounded pixel centres otherwise than the
  kernel: at an identity grid (how a spatial transformer starts) the grid's gradient came from the
  neighbouring cell (off by 41 where the largest gradient was 36, 48 of 288 entries); ONNX
  Runtime's ``GridSample`` rounds half-pixel ties otherwise in nearest mode (outputs off by 2.4).
  ``affine_grid`` goes with them: at pixel centres the sampler's gradient depends on the last bit
  of each grid point, and ONNX Runtime's product of the base grid and theta rounds otherwise than
  PyTorch's (the same identity start, ONNX Runtime computing the grid: off by 151 of 189).

- **Runtime checks** on values (``_assert_scalar`` from ``torch._check(n < 20)`` with ``n`` from
  ``.item()``, ``_assert_async`` from ``assert (x >= 0).all()`` inside a graph): ONNX has no way
  to raise; in PyTorch they raise as in eager (a ``RuntimeError``, where eager's Python ``assert``
  raises ``AssertionError``). So does ``binary_cross_entropy``, whose kernel refuses a target
  outside [0, 1]: in ONNX Runtime a 0/255 mask passed as the target trained on a loss of
  nonsense where eager raises (wave 34); and an integer division rounding toward zero by a
  tensor, which raises on a zero divisor where ONNX Runtime's ``Div`` made up a number (wave 35).

- **Translations that lose what PyTorch keeps**: onnxscript translates ``logcumsumexp`` as
  ``log(cumsum(exp(x - max(x)))) + max(x)`` with one maximum for the whole dimension, so a prefix
  far below the dimension's largest value underflows: ``[-100, 10]`` gave ``-inf`` for the first
  element where PyTorch gives -100, and every gradient NaN (wave 35). A stable form needs a scan
  (PyTorch's kernel adds each element in log space); ONNX has none that ONNX Runtime runs fast.
  Its backward, made of ``logcumsumexp`` too, goes with it. And a left shift of uint8 values:
  onnxscript shifts them as unsigned and casts the result to int8 (``200 << 1`` read back as
  -112 where PyTorch wraps to 144).

- **Antialiased resizing** (``F.interpolate(..., antialias=True)``, bilinear or bicubic): ONNX
  has no form of its backward, and onnxscript translates the forward right only when it is asked
  for a size without ``align_corners``: otherwise it resized by the ratio of the sizes, ignoring
  the scale factor PyTorch maps coordinates with (``scale_factor=0.6`` on 7 rows: 1 / 0.6
  against 7 / 4), and its ``align_corners`` is not PyTorch's (outputs off by up to 1.5 where they
  were about 2; wave 37). Those forwards and every backward run in PyTorch.

- **Double precision where the ONNX form has single precision**: ONNX attributes are float32, so
  ``celu``'s alpha, ``addmm``'s alpha and beta (``Gemm``'s) and ``HardSwish``'s slope carry
  float32 values into a float64 graph (as ``LayerNormalization``'s epsilon: a float64 LayerNorm the
  forward computes alone, its statistics recomputed in the backward as under activation
  checkpointing, ran in ONNX Runtime with eps 9.99999975e-06, 3e-13 off; wave 51), and the series
  ortrain wrote for the special functions ONNX
  lacks (``erfc``, ``erfcx``, ``log_ndtr``, ``lgamma``, ``mvlgamma``; see
  :mod:`ortrain.capture.late_decompositions`) and onnxscript's ``sinc`` are accurate to float32:
  on float64 tensors they were 1e-7 to 4e-6 relative off PyTorch's (1e-8 for the gradients),
  where every other op agrees to 1e-15 (wave 42). Those nodes on float64 tensors run in PyTorch.

Measured for the threshold, tiny GPT (4 layers, 4 heads of 64, batch 8; 2-core AMD EPYC, ONNX
Runtime placement, medians of alternated processes, OpenMP policy unset), step with flash in
PyTorch against the math form in ONNX Runtime: sequence 128 (2 MiB of probabilities per call)
352-358 against 331-339 ms, 256 (8 MiB) 690-691 against 718-780, 512 (32 MiB) 1491-1658 against
2014-2037. Hence 4 MiB.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ortrain.capture.attention_kernel import probability_bytes
from ortrain.export.flash_attention_math import attention_inputs, math_form_applies

aten = torch.ops.aten

# Attention whose probabilities take at least this many bytes per call stays in PyTorch's kernel.
FLASH_MIN_PROBABILITY_BYTES = 4 * 2**20

# Packets, so that every overload (``.default``, ``.out``-less variants, ``atol_rtol_tensor``) counts.
LINEAR_ALGEBRA: frozenset[object] = frozenset(
    {
        aten._linalg_check_errors,
        aten._linalg_det,
        aten._linalg_eigh,
        aten._linalg_slogdet,
        aten._linalg_solve_ex,
        aten._linalg_svd,
        aten.cholesky,
        aten.cholesky_inverse,
        aten.cholesky_solve,
        aten.geqrf,
        aten.linalg_cholesky_ex,
        aten.linalg_eig,
        aten.linalg_householder_product,
        aten.linalg_inv_ex,
        aten.linalg_ldl_factor_ex,
        aten.linalg_ldl_solve,
        aten.linalg_lstsq,
        aten.linalg_lu,
        aten.linalg_lu_factor_ex,
        aten.linalg_lu_solve,
        aten.linalg_matrix_exp,
        aten.linalg_pinv,
        aten.linalg_qr,
        aten.linalg_solve_triangular,
        aten.lu_unpack,
        aten.ormqr,
        aten.triangular_solve,
    }
)

FUSED_ATTENTION: frozenset[object] = frozenset(
    {
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_cudnn_attention_backward,
    }
)

# Every op PyTorch tags ``nondeterministic_seeded`` is here, in FUSED_ATTENTION, or never reaches a
# captured graph (tests/runtime/test_torch_native_ops.py checks it against the installed torch).
# The ``_functional`` forms are what an in-place draw becomes in a graph (``x.normal_()``,
# ``nn.init.normal_``): missing, such a draw ran in ONNX Runtime, from its own generator.
RANDOM: frozenset[object] = frozenset(
    {
        aten.native_dropout,
        aten._sample_dirichlet,
        aten._standard_gamma,
        aten.bernoulli,
        aten.binomial,
        aten.cauchy,
        aten.exponential,
        aten.geometric,
        aten.log_normal,
        aten.multinomial,
        aten.normal,
        aten.normal_functional,
        aten.poisson,
        aten.rand,
        aten.rand_like,
        aten.randint,
        aten.randint_like,
        aten.randn,
        aten.randn_like,
        aten.random,
        aten.randperm,
        aten.rrelu_with_noise,
        aten.rrelu_with_noise_functional,
        aten.uniform,
    }
)

GRID_SAMPLING: frozenset[object] = frozenset(
    {
        aten.affine_grid_generator,
        aten.affine_grid_generator_backward,
        aten.grid_sampler_2d,
        aten.grid_sampler_2d_backward,
        aten.grid_sampler_3d,
        aten.grid_sampler_3d_backward,
    }
)

# ``torch._check(n < 20)`` and ``assert (x >= 0).all()`` on values, and kernels that check their
# input's values (binary_cross_entropy's target in [0, 1]): ONNX cannot raise.
RUNTIME_CHECKS: frozenset[object] = frozenset(
    {aten._assert_scalar, aten._assert_async, aten.binary_cross_entropy}
)
STRIDED_VIEWS: frozenset[object] = frozenset({aten.as_strided, aten.as_strided_copy})
# The lazy negative and conjugate bits: ``z.conj().imag`` of a complex ``z`` is a real tensor
# viewed negated (``_neg_view``), next to the complex nodes it comes from.
LAZY_BIT_VIEWS: frozenset[object] = frozenset({aten._neg_view, aten._conj})
# Translated, but without the range PyTorch's kernel keeps (see the module's text).
LOSSY_TRANSLATIONS: frozenset[object] = frozenset({aten.logcumsumexp})
# Antialiased resizing: PyTorch's when the translation is wrong, its backward always.
ANTIALIASED_RESIZES: frozenset[object] = frozenset(
    {aten._upsample_bilinear2d_aa, aten._upsample_bicubic2d_aa}
)
ANTIALIASED_RESIZE_BACKWARDS: frozenset[object] = frozenset(
    {aten._upsample_bilinear2d_aa_backward, aten._upsample_bicubic2d_aa_backward}
)

# Whose ONNX form is float32-precise: on float64 tensors PyTorch runs them (the module's text).
SINGLE_PRECISION_FORMS: frozenset[object] = frozenset(
    {
        aten.celu,
        aten.hardswish,
        aten.hardswish_backward,
        aten.hardsigmoid_backward,
        aten.sinc,
        aten.erfc,
        aten.special_erfcx,
        aten.special_log_ndtr,
        aten.lgamma,
        aten.mvlgamma,
        aten.native_layer_norm,
    }
)

_WITH_EFFECTS = torch.ops.higher_order.with_effects

# The reasons two kinds are asked about by name (is_random, reads_memory_layout).
_RANDOM = "random numbers"
_STRIDED_VIEW = "strided view of memory laid out otherwise"


def _packet(target: object) -> object:
    return getattr(target, "overloadpacket", target)


def _tensors_touched(node: torch.fx.Node) -> list[torch.Tensor]:
    """The (fake) tensors ``node`` reads and writes."""
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    flat: list[object] = []
    for value in values:
        flat.extend(value if isinstance(value, (list, tuple)) else [value])
    return [v for v in flat if isinstance(v, torch.Tensor)]


def _contiguous_from_start(source: object) -> bool:
    """Whether the traced tensor ``source`` is laid out as ONNX Runtime holds it (contiguous, from
    offset 0); a layout that cannot be told (symbolic) counts as not."""
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return False
    return statically_known_true(value.is_contiguous()) and statically_known_true(value.storage_offset() == 0)


def torch_native_reason(node: torch.fx.Node) -> str | None:
    """Why PyTorch runs ``node`` by design, or None when ONNX Runtime should try it."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is _WITH_EFFECTS and len(node.args) > 1:
        target = node.args[1]  # with_effects(token, op, *args): the op it orders
    if _packet(target) in LINEAR_ALGEBRA:
        return "linear algebra"
    if _packet(target) in FUSED_ATTENTION and not _small_flash_attention(node):
        return "fused attention"
    if _packet(target) in RANDOM:
        return _RANDOM
    if _packet(target) in GRID_SAMPLING:
        return "grid sampling"
    if _packet(target) in RUNTIME_CHECKS or _integer_division(node):
        return "runtime check"
    if _packet(target) in LOSSY_TRANSLATIONS or _unsigned_left_shift(node):
        return "translation loses range"
    if _packet(target) in ANTIALIASED_RESIZE_BACKWARDS or _mistranslated_antialiasing(node):
        return "antialiased resizing"
    if _packet(target) in STRIDED_VIEWS and not _contiguous_from_start(node.args[0]):
        return _STRIDED_VIEW
    if _single_precision_form_of_doubles(node):
        return "double precision"
    touched = _tensors_touched(node)
    if any(t.is_complex() for t in touched) or _packet(target) in LAZY_BIT_VIEWS:
        return "complex tensor"
    if any(t.layout != torch.strided for t in touched):
        return "sparse tensor"
    return None


def _single_precision_form_of_doubles(node: torch.fx.Node) -> bool:
    """A float64 node whose ONNX form computes in float32 precision (see the module's text)."""
    value = node.meta.get("val")
    if isinstance(value, tuple | list) and value:  # (output, statistics...): the output's dtype
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float64:
        return False
    if _packet(node.target) in SINGLE_PRECISION_FORMS:
        return True
    if node.target is not aten.addmm.default:
        return False
    scales = [node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)]
    return any(scale != 1 for scale in scales)


def _unsigned_left_shift(node: torch.fx.Node) -> bool:
    """A left shift whose result is uint8 (see the module's text)."""
    if _packet(node.target) not in (aten.bitwise_left_shift, aten.__lshift__):
        return False
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


def _mistranslated_antialiasing(node: torch.fx.Node) -> bool:
    """An antialiased resize that onnxscript's translation gets wrong (see the module's text):
    ``align_corners``, or a scale factor other than the ratio of the sizes."""
    if _packet(node.target) not in ANTIALIASED_RESIZES:
        return False
    if node.target not in (aten._upsample_bilinear2d_aa.default, aten._upsample_bicubic2d_aa.default):
        return True  # the .vec overloads: a capture decomposes them, so never seen here
    args = [*node.args, None, None][:5]
    if node.kwargs.get("align_corners", args[2]):
        return True
    scales = node.kwargs.get("scales_h", args[3]), node.kwargs.get("scales_w", args[4])
    source, result = node.args[0].meta.get("val"), node.meta.get("val")
    for axis, scale in zip((-2, -1), scales, strict=True):
        if scale is None:
            continue
        sizes = source.shape[axis], result.shape[axis]
        if not all(isinstance(size, int) for size in sizes) or 1.0 / scale != sizes[0] / sizes[1]:
            return True
    return False


def _integer_division(node: torch.fx.Node) -> bool:
    """An integer ``div`` with ``rounding_mode="trunc"`` by a tensor: PyTorch raises
    ZeroDivisionError on a zero divisor, ONNX Runtime's ``Div`` returned the most negative int64
    (wave 35). The floor mode and ``%`` are translated with ``Mod``, whose kernel raises too."""
    if node.target is not aten.div.Tensor_mode or node.kwargs.get("rounding_mode") != "trunc":
        return False
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and value.dtype != torch.bool


def _small_flash_attention(node: torch.fx.Node) -> bool:
    """A CPU flash node that ONNX Runtime runs better in its math form (see the module's text)."""
    if not math_form_applies(node):
        return False
    query, key, _ = attention_inputs(node)
    if not all(isinstance(length, int) for length in (query.shape[-2], key.shape[-2])):
        return False  # an open length: any length may come (see the module's text)
    return probability_bytes(query, key) < FLASH_MIN_PROBABILITY_BYTES


def is_torch_native(node: torch.fx.Node) -> bool:
    return torch_native_reason(node) is not None


def is_random(node: torch.fx.Node) -> bool:
    return torch_native_reason(node) == _RANDOM


def reads_memory_layout(node: torch.fx.Node) -> bool:
    """Random draws and strided views: their results depend on their inputs' memory layout."""
    return torch_native_reason(node) in (_RANDOM, _STRIDED_VIEW)


# Determinants factor a contiguous matrix's transpose (det A = det Aᵀ), and the backward formula
# AOTAutograd traced reads the factors as the traced layout gave them.
_FACTORED_BY_LAYOUT = frozenset({aten._linalg_det, aten._linalg_slogdet})


def factors_by_layout(node: torch.fx.Node) -> bool:
    """A determinant: the LU factors it saves for its backward are Aᵀ's where its input is
    contiguous, A's where it is not, and the traced backward assumes the traced input's layout."""
    return node.op == "call_function" and _packet(node.target) in _FACTORED_BY_LAYOUT
