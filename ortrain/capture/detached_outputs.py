"""Outputs the forward returns without a gradient, handed to AOTAutograd as tensors of their own.

A forward may return a detached view of another output (``h, h[:, 0:1].detach()``: a per-row
weight or a target kept out of the gradient). Its graph returns both, and where ONNX Runtime's
runner makes the second as a view of the first (the graph's ``slice`` and ``detach`` on a
contiguous output, from the first capture with open sizes on), that view's base is the first
output: once AOTAutograd's node gives the first its gradient history, the view requires grad
through it, whatever AOTAutograd marks non-differentiable. Wave 45's review: from the second
batch size on the "constant" returned ``requires_grad=True`` and the loss's gradient flowed through
it (26 where eager's largest was 5, the loss then diverging), and on the graph-break path a
``bincount`` whose weights were such a view failed its backward.

Each output AOTAutograd's metadata says does not require grad, and that is a view, is detached
before AOTAutograd sees it: the same memory, and no base.
"""

from __future__ import annotations

from typing import Any

import torch


def detached_outputs(metadata: Any) -> frozenset[int]:
    """The positions, among the compiled forward's outputs, of the user's outputs that do not
    require grad (``metadata``: AOTAutograd's view of the forward; None: none known)."""
    if metadata is None:
        return frozenset()
    first = metadata.num_mutated_inp_runtime_indices  # the new values of mutated inputs come first
    return frozenset(first + i for i, info in enumerate(metadata.output_info) if not info.requires_grad)


def detach_views(positions: frozenset[int], outputs: list[Any]) -> None:
    """Detach, in ``outputs``, the views at ``positions``."""
    for position in positions:
        if position < len(outputs):
            output = outputs[position]
            if isinstance(output, torch.Tensor) and output._is_view():
                outputs[position] = output.detach()
