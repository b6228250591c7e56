"""Scatters and gathers on 0-d tensors, done on 1-element tensors.

PyTorch's backward of a reduction over a 0-d tensor (``max(x, 0)`` with ``x`` a scalar) scatters
into a 0-d tensor; ONNX Runtime's ScatterElements and GatherElements reject rank 0 at run time
("axis 0 is not in valid range").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def _on_one_element(op: Any) -> Callable[..., Any]:
    def decomposition(x: torch.Tensor, dim: int, *args: Any, **kwargs: Any) -> Any:
        if x.dim() != 0:
            return NotImplemented
        lifted = [a.reshape(1) if isinstance(a, torch.Tensor) and a.dim() == 0 else a for a in args]
        # A scatter's result has the target's shape; a gather's has its index's, which PyTorch
        # lets be 1-d over a 0-d tensor (wave 37: ``gather(scalar, 0, zeros(1))`` came back 0-d).
        shape = args[0].shape if op is aten.gather.default else ()
        return op(x.reshape(1), dim, *lifted, **kwargs).reshape(shape)

    decomposition.__name__ = f"{op.__name__}_on_0d"
    return decomposition


SCALAR_INDEXING_OPS = (
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
    aten.gather.default,
)


def scalar_indexing_table() -> dict[Any, Callable[..., Any]]:
    return {op: _on_one_element(op) for op in SCALAR_INDEXING_OPS}
