"""Arguments PyTorch accepts and ONNX Runtime's CPU kernels refuse when the session runs.

Such a node exports and its session loads, so neither the export nor the session's creation
rejects it: the first run fails, and until wave 37 that failure sent the whole model back to
PyTorch (with the fallback warning). Refused at partitioning instead, the node alone runs in
PyTorch, under the default policy with the per-operator warning, and ``FALLBACK_DISABLE`` names
it before anything runs.

- A transposed convolution whose ``output_padding`` is not below its ``stride`` in every
  dimension, which PyTorch allows when the dilation is larger: ONNX Runtime (1.32) recomputes the
  input size from the output size and fails ("output_padding (3) may be too large for stride
  (2)").
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def kernel_refusal(node: torch.fx.Node) -> str | None:
    """Why ONNX Runtime's kernel would fail on ``node``'s arguments, or None."""
    if node.target is aten.convolution.default:
        return _transposed_convolution(node)
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
