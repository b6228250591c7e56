"""Nodes that export and load in ONNX Runtime but do not run as PyTorch's: refused at partitioning.

Neither the export nor the session's creation rejects such a node. Refused at partitioning, it
alone runs in PyTorch, under the default policy with the per-operator warning, and
``FALLBACK_DISABLE`` names it before anything runs.

- A transposed convolution whose ``output_padding`` is not below its ``stride`` in every
  dimension, which PyTorch allows when the dilation is larger: ONNX Runtime (1.32) recomputes the
  input size from the output size and fails ("output_padding (3) may be too large for stride
  (2)"). Until wave 37 that failure, at the first run, sent the whole model back to PyTorch.
- Adaptive average pooling (2-d) over a size the graph leaves open, into more than one cell: it
  has no ONNX translation, and the decomposition the export inlines is traced on the sizes of one
  call, whose windows it keeps (wave 37: a length-8 trace gave wrong averages at length 11,
  silently). Into one cell (a global average pool) or over fixed sizes it exports right.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def kernel_refusal(node: torch.fx.Node) -> str | None:
    """Why ONNX Runtime would not run ``node`` as PyTorch does (see the module), or None."""
    if node.target is aten.convolution.default:
        return _transposed_convolution(node)
    if node.target is aten._adaptive_avg_pool2d.default:
        return _adaptive_pooling_over_an_open_size(node)
    if node.target in (aten.embedding_renorm.default, aten.embedding_renorm_.default):
        return _embedding_renorm(node)
    return None


def _embedding_renorm(node: torch.fx.Node) -> str | None:
    """``nn.Embedding(max_norm=...)``: onnxscript's translation takes a row's norm as
    ``sum(|w|^p)^(1/p)``, which is 1 for ``norm_type=inf`` and ``-inf`` (every looked-up row scaled
    by ``max_norm``: a loss 0.16 for eager's 0.39, wave 46's review), and writes ``max_norm`` as a
    float32 constant, 4e-8 off in a float64 model."""
    norm_type = node.args[3] if len(node.args) > 3 else node.kwargs.get("norm_type", 2.0)
    weight = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if isinstance(norm_type, float | int) and not math.isfinite(norm_type):
        return f"its ONNX translation computes norm_type={norm_type} as a sum of powers, not a maximum"
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.float64:
        return "its ONNX translation rounds max_norm to float32 in a float64 embedding"
    return None


def _adaptive_pooling_over_an_open_size(node: torch.fx.Node) -> str | None:
    source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(source, torch.Tensor):
        return None
    for size, cells in zip(source.shape[-2:], node.args[1], strict=True):
        if cells != 1 and not isinstance(size, int):
            return (
                "its export fixes the pooling windows for the sizes of one call, and this size is left open"
            )
    return None


def _transposed_convolution(node: torch.fx.Node) -> str | None:
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    stride, transposed, output_padding = node.args[3], node.args[6], node.args[7]
    if not transposed or not all(isinstance(v, int) for v in (*stride, *output_padding)):
        return None
    if all(pad < step for pad, step in zip(output_padding, stride, strict=True)):
        return None
    return (
        f"ONNX Runtime's ConvTranspose fails on an output_padding {list(output_padding)} not below "
        f"the stride {list(stride)}"
    )
