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

import torch

aten = torch.ops.aten


def kernel_refusal(node: torch.fx.Node) -> str | None:
    """Why ONNX Runtime would not run ``node`` as PyTorch does (see the module), or None."""
    if node.target is aten.convolution.default:
        return _transposed_convolution(node)
    if node.target is aten._adaptive_avg_pool2d.default:
        return _adaptive_pooling_over_an_open_size(node)
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
