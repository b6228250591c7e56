"""Random operators run by PyTorch get their inputs in the layout the capture recorded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule
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


class _Determinants(nn.Module):
    """Glow's invertible 1x1 convolution: a column-major weight (``torch.linalg.qr``'s Q) whose
    log-determinant is taken of a float64 copy, or of elementwise results that keep its layout;
    ONNX Runtime hands those over contiguous."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.linalg.qr(torch.randn(4, 4))[0] + 3 * torch.eye(4))
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight
        if self.form == "slogdet of float64":
            logdet = torch.linalg.slogdet(self.weight.double())[1].float()
        elif self.form == "det of tanh":
            logdet = torch.linalg.det(torch.tanh(self.weight) + 2 * torch.eye(4))
        elif self.form == "logdet of a product":
            logdet = torch.logdet(self.weight * 1.5)
        elif self.form == "det of a slice":  # gaps: not dense (the review of wave 48's diff)
            logdet = torch.linalg.det(torch.cat([self.weight * 1.5, self.weight], 1)[:, :4])
        else:  # a broadcast
            logdet = torch.linalg.det((self.weight.t() * 1.5).expand(3, 4, 4)).sum()
        return h.square().mean() - logdet


FORMS = ["slogdet of float64", "det of tanh", "logdet of a product", "det of a slice", "det of a broadcast"]


@pytest.mark.parametrize("form", FORMS)
def test_determinants_get_their_input_in_the_recorded_layout(form: str) -> None:
    """PyTorch factors a contiguous matrix's transpose, and the traced backward solves with the
    factors the traced layout gave: a column-major matrix reaching ``slogdet`` contiguous from ONNX
    Runtime got the gradient of its transpose (wave 48's review), with the loss exact."""
    eager = _Determinants(form)
    assert eager.weight.stride() == (1, 4)
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for module in (wrapped, eager):
            module.zero_grad()
            module(x).backward()
        torch.testing.assert_close(model.weight.grad, eager.weight.grad)
    (entry,) = (e for group in wrapped._ortrain_graphs.values() for e in group)
    assert not entry.capture.forward.runner.plan.whole  # ONNX Runtime hands the matrix over
