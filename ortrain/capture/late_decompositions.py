"""Operators a capture keeps whole, for PyTorch's fused kernels, and the export decomposes.

``convolution_backward``, training-mode batch norm (``_native_batch_norm_legit_functional``
and ``native_batch_norm_backward``) and ``silu_backward`` (SwiGLU's, in Llama-style MLPs) have no
correct ONNX translation (none for the backwards; onnxscript's batch norm hard-codes inference
mode), so until wave 15 every capture decomposed them: a convolution's gradients into two
convolutions with permuted operands, batch norm into a dozen elementwise ops, SiLU's gradient
into four. Where op tuning placed those graphs in PyTorch (every graph of the small
ResNet benchmark), PyTorch ran the decomposed form instead of oneDNN's convolution backward and
its one-pass batch norm kernels: 1.76× eager's step. Now the graphs keep the operators, the torch
executor runs PyTorch's kernels, and the export (:mod:`ortrain.export.direct_translation`)
inlines these decompositions, traced on each node's values, before translating a region for
ONNX Runtime, which therefore gets the same ONNX as before.

The special functions that ONNX lacks (``hypot``, ``erfinv``, ``erfc``, ``erfcx``, ``log_ndtr``,
``ndtri``, ``lgamma``, ``digamma``, ``polygamma``, ``mvlgamma``, the modified Bessel functions)
joined them in wave 35: their series and recurrences (``decompositions_special``,
``decompositions_bessel``, ``decompositions_math``) were written for ONNX Runtime, and until then
every capture used them, so the all-torch placement op tuning keeps on many CPUs computed
``lgamma(2)`` as 9.5e-7 where PyTorch's kernel gives 0 and ``digamma`` 75 ulp off near its root,
with a dozen elementwise ops where PyTorch has one kernel. Their backward formulas name the same
functions (``lgamma' = digamma``, ``i0' = i1``), so the backward graphs keep them too.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import get_decompositions

from ortrain.capture import decompositions_bessel as bessel
from ortrain.capture import decompositions_math as math_ops
from ortrain.capture import decompositions_special as special
from ortrain.capture.decompositions import convolution_backward, input_gradient_of_any_size

aten = torch.ops.aten

# Special functions ONNX lacks, with the forms written for it.
_SPECIAL_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    aten.hypot.default: math_ops.hypot,
    aten.erfinv.default: math_ops.erfinv,
    aten.erfc.default: special.erfc,
    aten.special_erfcx.default: special.erfcx,
    aten.special_log_ndtr.default: special.log_ndtr,
    aten.lgamma.default: special.lgamma,
    aten.digamma.default: special.digamma,
    aten.polygamma.default: special.polygamma,
    aten.mvlgamma.default: special.mvlgamma,
    aten.special_ndtri.default: special.ndtri,
    aten.i0.default: bessel.i0,
    aten.special_i0e.default: bessel.special_i0e,
    aten.special_i1.default: bessel.special_i1,
    aten.special_i1e.default: bessel.special_i1e,
}


def _index_fill(x: torch.Tensor, dim: int, index: torch.Tensor, value: Any) -> torch.Tensor:
    """``index_fill`` as a ``where`` over a mask of the filled positions: PyTorch's reference
    keeps a non-contiguous input's strides with ``prims.copy_strided``, which has no ONNX
    translation (wave 47's review: ``h.t().index_fill(1, idx, 0)``, and the backward of
    ``index_reduce(amax, include_self=False)`` on a transposed tensor, were refused under
    ``FALLBACK_DISABLE``, and ran in PyTorch otherwise). ONNX has no strides to keep."""
    dim = dim % max(x.dim(), 1)
    size = x.shape[dim] if x.dim() else 1
    marked = torch.ones_like(index.reshape(-1), dtype=torch.bool)
    mask = torch.zeros(size, dtype=torch.bool, device=x.device).index_put((index.reshape(-1),), marked)
    shape = [1] * x.dim()
    if x.dim():
        shape[dim] = size
    filled = value.to(x.dtype) if isinstance(value, torch.Tensor) else x.new_full((), value)
    return torch.where(mask.reshape(shape), filled, x)


_INDEX_FILLS: dict[Any, Callable[..., Any]] = {
    aten.index_fill.int_Scalar: _index_fill,
    aten.index_fill.int_Tensor: _index_fill,
}


# (NotImplemented: the operator as it is, once its operands agree; the trace of a decomposition
# decomposes what it calls too.)
def _stack(tensors: list[torch.Tensor], dim: int = 0) -> Any:
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    if all(t.dtype == dtype for t in tensors):
        return NotImplemented
    return torch.stack([t.to(dtype) for t in tensors], dim)


def _pow(base: torch.Tensor, exponent: torch.Tensor) -> Any:
    dtype = torch.result_type(base, exponent)
    if base.dtype == exponent.dtype == dtype:
        return NotImplemented
    return torch.pow(base.to(dtype), exponent.to(dtype))


# Operators whose operands PyTorch promotes to a common dtype and torch.onnx's type promotion
# leaves as they are: ``torch.stack`` of an int64 and a float tensor, an int tensor raised to a
# float tensor's power (wave 48's review: ONNX Runtime refused the region, "bound to different
# types", and the model ran in PyTorch, an error under FALLBACK_DISABLE). The export casts their
# operands first, where they differ.
_PROMOTING: dict[Any, Callable[..., Any]] = {
    aten.stack.default: _stack,
    aten.pow.Tensor_Tensor: _pow,
}


def _operand_dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    operands = node.args[0] if node.target is aten.stack.default else node.args[:2]
    values = [a.meta.get("val") for a in operands if isinstance(a, torch.fx.Node)]
    return {v.dtype for v in values if isinstance(v, torch.Tensor)}


def _transposed_convolution_of_open_size(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[Any],
    groups: int,
) -> Any:
    """A transposed convolution whose output padding depends on an open size
    (``ConvTranspose2d(...)(h, output_size=skip.shape[-2:])``, a U-Net's up path over images whose
    sizes vary): ONNX's ``ConvTranspose`` takes the output padding as a fixed attribute, and the
    export failed ("Unsupported attribute type: list"), sending the forward region to PyTorch
    (wave 50's review). Written as the input gradient of such a size, which a backward already
    computes so (:func:`ortrain.capture.decompositions.input_gradient_of_any_size`)."""
    if not transposed or all(isinstance(p, int) for p in output_padding):
        return NotImplemented
    spatial = weight.dim() - 2
    kernel = weight.shape[2:]
    # The output's sizes, as ``ConvTranspose``'s shape rule gives them.
    sizes = [
        (input.shape[2 + i] - 1) * stride[i]
        - 2 * padding[i]
        + dilation[i] * (kernel[i] - 1)
        + output_padding[i]
        + 1
        for i in range(spatial)
    ]
    out = input_gradient_of_any_size(input, weight, sizes, stride, padding, dilation, groups)
    return out if bias is None else out + bias.reshape([1, -1] + [1] * spatial)


def _open_output_padding(node: torch.fx.Node) -> bool:
    """Whether a ``convolution`` node is transposed with an output padding the sizes compute."""
    args = [*node.args, *[None] * 9][:9]
    return bool(args[6]) and any(isinstance(p, torch.fx.Node) for p in args[7] or ())


LATE_OPS = frozenset(
    {
        *_INDEX_FILLS,
        aten.convolution_backward.default,
        aten._native_batch_norm_legit_functional.default,
        # Batch norm without running statistics (``F.batch_norm(x, None, None, training=True)``):
        # torchlib's translation returns float32 statistics in a float64 model (wave 44).
        aten._native_batch_norm_legit.no_stats,
        aten.native_batch_norm_backward.default,
        aten.silu_backward.default,
        *_SPECIAL_FUNCTIONS,
    }
)


def late_decompositions() -> dict[Any, Callable[..., Any]]:
    table = get_decompositions(
        [
            aten._native_batch_norm_legit_functional,
            aten._native_batch_norm_legit.no_stats,
            aten.native_batch_norm_backward,
            aten.silu_backward,
            aten._native_batch_norm_legit_no_training,
            # which PyTorch's decomposition of the eval-mode one above calls
            aten._native_batch_norm_legit.default,
        ]
    )
    table[aten.convolution_backward.default] = convolution_backward
    table[aten.convolution.default] = _transposed_convolution_of_open_size
    table.update(_SPECIAL_FUNCTIONS)
    table.update(_INDEX_FILLS)
    table.update(_PROMOTING)
    no_training = aten._native_batch_norm_legit_no_training.default
    table[no_training] = functools.partial(_batch_norm_without_statistics, table[no_training])
    return table


def _batch_norm_without_statistics(
    decomposition: Callable[..., Any], *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eval-mode batch norm as PyTorch's kernel returns it: the normalized input and two empty
    "saved statistics" (its backward reads the running ones); torch's own ``decomposition``
    returns the running statistics there, which disagrees with the op's shapes."""
    output = decomposition(*args)[0]
    return output, output.new_zeros((0,)), output.new_zeros((0,))


def decomposed_for_export(node: torch.fx.Node) -> bool:
    """Whether the export decomposes ``node`` with :func:`late_decompositions`. Also eval-mode
    batch norm in float64 (below), or whose saved statistics are read (a model in eval() that
    still trains): onnxscript
    returns them with the channels' size where PyTorch's are empty, and the backward graph's
    session refused the forward's outputs."""
    if node.op != "call_function":
        return False
    if node.target in LATE_OPS:
        return True
    if node.target in _PROMOTING:
        return len(_operand_dtypes(node)) > 1
    if node.target is aten.convolution.default:
        return _open_output_padding(node)
    if node.target is not aten._native_batch_norm_legit_no_training.default:
        return False
    # A float64 one too: ONNX's BatchNormalization holds ``epsilon`` as a float32 attribute, 1e-3
    # became 0.0010000000475 (2e-8 relative off eager at small variances, wave 47's review); the
    # decomposition's ``var + eps`` takes the number as an operand, which a float64 graph keeps
    # exact (:mod:`ortrain.export.double_precision_constants`).
    value = node.meta.get("val")
    output = value[0] if isinstance(value, tuple | list) and value else value
    if isinstance(output, torch.Tensor) and output.dtype == torch.float64:
        return True
    return any(user.target is operator.getitem and user.args[1] != 0 for user in node.users)
