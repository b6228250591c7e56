"""A slice's or select's backward is a Pad or a Concat in ONNX, with the same values."""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable

import onnxruntime as ort
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.export.fx_to_onnx import export_graph
from ortrain.export.slice_backward_copies import copy_slice_backwards

aten = torch.ops.aten
_MAX = 9223372036854775807  # what AOTAutograd writes for an open end

_BACKWARDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # rotate_half's two halves, as a Llama's backward holds them
    "first half of the last dim": lambda g, base: aten.slice_backward(g[..., :16], [4, 8, 32], -1, 0, 16, 1),
    "second half, open end": lambda g, base: aten.slice_backward(g[..., 16:], [4, 8, 32], 2, 16, _MAX, 1),
    "a middle dim, negative start": lambda g, base: aten.slice_backward(
        g[:, -3:], [4, 8, 32], 1, -3, _MAX, 1
    ),
    "slice_scatter into values": lambda g, base: aten.slice_scatter(base, g[:, 2:5], 1, 2, 5),
    "slice_scatter, first rows": lambda g, base: aten.slice_scatter(base, g[:1], 0, 0, 1),
    # BLOOM's fused query-key-value split: h.view(..., 3, d)[..., i, :]
    "select_backward, middle": lambda g, base: aten.select_backward(g[:, :, 1], [4, 8, 32], 2, 1),
    "select_backward, negative index": lambda g, base: aten.select_backward(g[:, -1], [4, 8, 32], 1, -1),
    "select_backward, first": lambda g, base: aten.select_backward(g[0], [4, 8, 32], 0, 0),
}


@pytest.mark.parametrize("name", list(_BACKWARDS))
def test_the_same_values_in_pytorch_and_onnx_runtime(name: str) -> None:
    g, base = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    g[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    expected = _BACKWARDS[name](g, base)
    backward = _BACKWARDS[name]
    gm = make_fx(lambda g, base: (backward(g, base),), tracing_mode="fake")(g, base)  # export's form
    rewritten = make_fx(backward, tracing_mode="fake")(g, base)
    assert copy_slice_backwards(rewritten) == 1
    targets = {n.target for n in rewritten.graph.nodes if n.op == "call_function"}
    assert not targets & {
        aten.slice_scatter.default,
        aten.slice_backward.default,
        aten.select_backward.default,
    }
    torch.testing.assert_close(rewritten(g, base), expected, equal_nan=True, rtol=0, atol=0)
    exported = export_graph(gm, opset_version=18)
    ops = collections.Counter(node.op_type for node in exported.model.graph.node)
    assert not {"ScatterND", "ScatterElements", "Transpose"} & set(ops), ops
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = dict(zip(names, [t.numpy() for t in (g, base)][: len(names)], strict=False))
    got = torch.from_numpy(session.run(None, feeds)[0])
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))


def test_a_step_other_than_one_and_an_empty_range_stay() -> None:
    g = torch.randn(4, 8)
    stepped = make_fx(lambda g: aten.slice_backward(g[:, ::2], [4, 8], 1, 0, _MAX, 2), tracing_mode="fake")(g)
    assert copy_slice_backwards(stepped) == 0
    empty = make_fx(lambda g: aten.slice_scatter(g, g[:, 5:3], 1, 5, 3), tracing_mode="fake")(g)
    assert copy_slice_backwards(empty) == 0


class _FusedQueryKeyValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(32, 96)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, _ = h.shape
        q, k, v = self.project(h).view(batch, length, 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, :-1, :, 2:7]
        return out.square().mean()


def test_the_rewrite_keeps_sizes_symbolic() -> None:
    """Computing the padded values on fake tensors compared a symbolic length with its hint: until
    wave 42 the dynamic graph was specialized to one length, and every new length captured again."""
    from ortrain import ORTModule

    torch.manual_seed(0)
    eager = _FusedQueryKeyValue()
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in range(3, 9):
        h = torch.randn(2, length, 32)
        want, got = eager(h), wrapped(h)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(wrapped.project.weight.grad, eager.project.weight.grad)
    assert sum(len(entries) for entries in wrapped._ortrain_graphs.values()) == 2  # static, then dynamic
