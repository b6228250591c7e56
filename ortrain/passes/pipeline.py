"""The ordered list of graph passes, and saving each stage for debugging."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from ortrain.passes.bitwise_where import select_by_bit_mask
from ortrain.passes.boolean_reductions import reduce_booleans_as_bytes
from ortrain.passes.compute_optimizer import upstream_selections
from ortrain.passes.erf_gelu import fuse_erf_gelu
from ortrain.passes.label_sparsity import gather_counted_labels
from ortrain.passes.leading_axis_sums import sum_leading_axes_by_matmul
from ortrain.passes.linear_cross_entropy import fuse_linear_cross_entropy as fuse_linear_cross_entropy_pass
from ortrain.passes.log_sum_exp import decompose_log_sum_exp
from ortrain.passes.loss_head_gradient import rewrite_loss_head_gradient
from ortrain.passes.padding_elimination import eliminate_padding
from ortrain.passes.scalar_powers import powers_as_products
from ortrain.passes.scatter_nd_accumulation import serialize_scatter_nd_accumulation
from ortrain.passes.transposed_matmul import fuse_transposed_matmuls

logger = logging.getLogger("ortrain.passes")

Pass = Callable[[onnx.ModelProto], onnx.ModelProto]
# A rewrite of the pre-dispatch forward graph, before AOTAutograd differentiates it: edits the
# graph in place and returns one line per change.
ForwardRewrite = Callable[[torch.fx.GraphModule], list[str]]


@dataclass(frozen=True)
class StageSaver:
    """Writes ``{prefix}_{graph}_{stage}_{mode}.onnx`` files when ``DebugOptions(save_onnx=True)``."""

    directory: Path
    prefix: str
    mode: str  # "training" or "inference"

    def save(self, model: onnx.ModelProto, graph: str, stage: str) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.prefix}_{graph}_{stage}_{self.mode}.onnx"
        onnx.save(model, path)
        logger.info("saved %s", path)
        return path


def default_passes(*, compute_optimizer: bool) -> list[tuple[str, Pass]]:
    """The passes in the order they run. ``compute_optimizer`` is ORTMODULE_ENABLE_COMPUTE_OPTIMIZER."""
    del compute_optimizer  # no pass has landed yet that changes what is computed
    # Not a compute change: the fused product ONNX Runtime would make anyway, at the exported place
    # in the order (see transposed_matmul.py), so that gradients are freed layer by layer.
    # Work removal, same values up to float32 rounding: the LM head's gradients straight from the
    # softmax, without the N x V gradient of the logits (see loss_head_gradient.py). After the
    # matmul fusion, whose FusedMatMul(transA) it reads.
    return [
        ("fuse_transposed_matmuls", fuse_transposed_matmuls),
        ("rewrite_loss_head_gradient", rewrite_loss_head_gradient),
        # Correctness, not speed: ONNX Runtime's CPU ScatterND loses additions to a repeated index
        # when it runs on several threads (an embedding's gradient); see scatter_nd_accumulation.py.
        ("serialize_scatter_nd_accumulation", serialize_scatter_nd_accumulation),
        # One pass over the activation where the exact GELU was five: ONNX Runtime's CPU Gelu
        # kernel, which its own fusion misses in the exporter's node order (see erf_gelu.py).
        ("fuse_erf_gelu", fuse_erf_gelu),
        # The attention math form's log-sum-exp as vectorized kernels: ONNX Runtime's
        # ReduceLogSumExp is 6x slower over the last axis (see log_sum_exp.py).
        ("decompose_log_sum_exp", decompose_log_sum_exp),
        # Bias and norm gradients (sums over the rows) through MLAS's product, not ONNX Runtime's
        # ReduceSum, which is slow over leading axes at some sizes (see leading_axis_sums.py).
        ("sum_leading_axes_by_matmul", sum_leading_axes_by_matmul),
        # ONNX Runtime's Pow calls pow() per element; PyTorch's kernel squares, cubes, takes roots
        # and reciprocals for these exponents, and so does this, with eager's values (scalar_powers.py).
        ("powers_as_products", powers_as_products),
        # torch.all / torch.any over a mask: ONNX Runtime reduces int64 8x slower than bytes.
        ("reduce_booleans_as_bytes", reduce_booleans_as_bytes),
        # Last, so that it sees the Where nodes the passes above write too: ONNX Runtime's Where
        # runs one element at a time; the same bits through integer products (bitwise_where.py).
        ("select_by_bit_mask", select_by_bit_mask),
    ]


def forward_rewrites(
    *,
    compute_optimizer: bool,
    sparse_optimizer: bool,
    embedding_sparse_optimizer: bool,
    memory_opt_level: int = 0,
    fuse_linear_cross_entropy: bool = True,
) -> list[ForwardRewrite]:
    """The forward-graph rewrites in the order they run, as the ORTMODULE_ENABLE_* switches ask.

    A language model's head and loss become one chunked computation with its gradients in the
    forward (compute optimizer; from memory optimizer level 1 it gathers counted labels per chunk,
    bounding the logits in memory, rather than once before the head). Label sparsity then
    inserts a gather before each other loss; the compute optimizer moves gathers and slices (that
    one included) up past token-wise layers; padding elimination drops pad tokens after the
    embedding.
    """
    rewrites: list[ForwardRewrite] = []
    if compute_optimizer and fuse_linear_cross_entropy:
        rewrites.append(
            functools.partial(
                fuse_linear_cross_entropy_pass, sparse=sparse_optimizer, chunked_gathers=memory_opt_level >= 1
            )
        )
    if sparse_optimizer:
        rewrites.append(gather_counted_labels)
    if embedding_sparse_optimizer:
        rewrites.append(eliminate_padding)
    if compute_optimizer:
        rewrites.append(upstream_selections)
    return rewrites


def run_passes(
    model: onnx.ModelProto,
    passes: list[tuple[str, Pass]],
    *,
    graph: str,
    saver: StageSaver | None,
) -> onnx.ModelProto:
    if saver is not None:
        saver.save(model, graph, "exported")
    for name, apply in passes:
        model = apply(model)
        logger.debug("%s graph: applied pass %s", graph, name)
    if saver is not None:
        saver.save(model, graph, "optimized")
    return model
