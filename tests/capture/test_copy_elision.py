"""Forward copies that keep their input's layout are dropped, unless the copy is what a user gets."""

from __future__ import annotations

import torch
from torch import nn

from ortrain.capture.aot_capture import capture

aten = torch.ops.aten


class _Copies(nn.Module):
    """``inner`` is a copy only the backward needs; ``returned`` is a copy the caller gets."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.tanh(x * self.w)
        inner = h.clone()  # same layout as h: reading h is the same
        returned = h.clone()
        return (inner * inner).sum(), returned, h


def _clones(graph: torch.fx.GraphModule) -> int:
    return sum(1 for n in graph.graph.nodes if n.target is aten.clone.default)


def test_a_layout_preserving_copy_is_dropped_but_a_returned_one_is_kept() -> None:
    module = _Copies()
    x = torch.randn(4, 8)
    captured = capture(module, [x], training=True)
    assert _clones(captured.forward.graph) == 1  # the returned copy only
    loss, returned, h = captured([module.w], [x])
    assert returned.data_ptr() != h.data_ptr()  # the caller's copy does not alias h
    loss.backward()
    expected = module.w.grad.clone()
    module.w.grad = None
    eager_loss, _, _ = module(x)
    eager_loss.backward()
    torch.testing.assert_close(expected, module.w.grad)
