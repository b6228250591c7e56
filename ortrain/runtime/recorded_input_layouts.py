"""A graph PyTorch runs whole gets its inputs in the memory layouts it was captured with.

AOTAutograd records ``x.reshape(...)`` on a contiguous input as ``view``: the graph is only valid
for the strides it was traced with. Graph keys hold dtypes and sizes, not strides, so one graph
serves a batch that arrives transposed (a data pipeline that permutes, a ``.t()`` of another
tensor): ONNX Runtime copies such an input into its own contiguous buffer anyway, but PyTorch's
placement of the same graph (op tuning's first calls, or its choice) failed with "view size is not
compatible with input tensor's size and stride", and the fallback policy then trained the model in
PyTorch for good (wave 19). An input whose layout differs from the recorded one is copied into it
first; outputs that alias inputs are rebuilt from the caller's tensors outside the graph, so no
aliasing is lost. Inputs recorded with gaps (a strided slice) are passed as they come.
"""

from __future__ import annotations

from typing import Any

import torch

from ortrain.capture.memory_layouts import dense_dim_order
from ortrain.runtime.random_op_layouts import in_dim_order


class RecordedInputLayouts:
    """The dense layout each tensor input of ``graph`` was captured in, restored on demand."""

    def __init__(self, graph: torch.fx.GraphModule) -> None:
        placeholders = graph.graph.find_nodes(op="placeholder")
        self._contiguous: list[int] = []
        self._permuted: list[tuple[int, tuple[int, ...]]] = []
        for i, node in enumerate(placeholders):
            value = node.meta.get("val")
            order = dense_dim_order(value)
            if order is None or not isinstance(value, torch.Tensor) or value.dim() < 2:
                continue
            if order == tuple(range(value.dim())):
                self._contiguous.append(i)
            else:
                self._permuted.append((i, order))

    def restore(self, args: list[Any]) -> list[Any]:
        """``args``, with a copy in place of each tensor whose layout is not the recorded one."""
        changed: list[Any] | None = None
        for i in self._contiguous:
            arg = args[i]
            if isinstance(arg, torch.Tensor) and not arg.is_contiguous():
                changed = changed or list(args)
                changed[i] = arg.contiguous()
        for i, order in self._permuted:
            arg = args[i]
            if isinstance(arg, torch.Tensor):
                laid_out = in_dim_order(arg, order)
                if laid_out is not arg:
                    changed = changed or list(args)
                    changed[i] = laid_out
        return args if changed is None else changed
