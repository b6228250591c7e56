"""Random operators run by PyTorch get their inputs in the layout the capture recorded."""

from __future__ import annotations

import torch

from ortrain.capture.memory_layouts import permuted_dim_order
from ortrain.runtime.random_op_layouts import in_dim_order


def test_permuted_dim_order_names_a_dense_permuted_layout_only() -> None:
    transposed = torch.empty(10, 4, 32).transpose(0, 1)  # (4, 10, 32), strides (32, 128, 1)
    assert permuted_dim_order(transposed) == (1, 0, 2)
    assert permuted_dim_order(torch.empty(4, 10, 32)) is None  # contiguous: nothing to restore
    assert permuted_dim_order(torch.empty(4, 1).expand(4, 8)) is None  # broadcast: not dense
    assert permuted_dim_order(torch.empty(4, 10)[:, ::2]) is None  # gaps: not dense
    assert permuted_dim_order(torch.empty(7)) is None


def test_in_dim_order_keeps_values_and_draws_like_eager() -> None:
    source = torch.randn(10, 4, 32)
    eager_input = source.transpose(0, 1)
    from_other_executor = eager_input.contiguous()  # how ONNX Runtime hands the value over
    laid_out = in_dim_order(from_other_executor, (1, 0, 2))
    assert torch.equal(laid_out, eager_input)
    assert laid_out.stride() == eager_input.stride()
    assert in_dim_order(eager_input, (1, 0, 2)) is eager_input  # already laid out: no copy
    # The reason: a random draw "like" the input fills memory in order.
    torch.manual_seed(0)
    eager_mask = torch.nn.functional.dropout(eager_input, 0.5)
    torch.manual_seed(0)
    restored_mask = torch.nn.functional.dropout(laid_out, 0.5)
    torch.manual_seed(0)
    contiguous_mask = torch.nn.functional.dropout(from_other_executor, 0.5)
    assert torch.equal(restored_mask, eager_mask)
    assert not torch.equal(contiguous_mask, eager_mask)
