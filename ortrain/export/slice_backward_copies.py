"""The backward of a slice or a select as the copies it is (``Pad``, ``Concat``), not a scatter
between two transposes.

The backward of every slice (``x[..., :half]``: rotary embeddings' ``rotate_half``, a split of
heads or of gates, ``narrow``) writes the gradient into zeros with ``slice_scatter``. onnxscript
translates it by moving the sliced dimension to the front, scattering rows with ``ScatterND`` and
moving it back: two ``Transpose`` of the whole tensor, and with the last dimension moved first
ONNX Runtime's ``Transpose`` copies one element at a time (about 1 ms for ``[32, 8, 128, 8]``
float32, onnxruntime 1.32, 2-core AMD EPYC, Zen 5). A tiny Llama's backward spent 20 ms of its
138 ms kernel time in ``Transpose``, most of it there.

``slice_scatter(base, src, dim, start, end)`` is ``cat([base[:start], src, base[end:]], dim)``:
the same elements, copied; ``slice_backward(grad, sizes, dim, start, end)`` (the form
AOTAutograd's backward graphs hold) is ``grad`` padded with zeros, one ONNX ``Pad``. A
``select`` (``x[..., 0, :]``: BLOOM's fused query-key-value split) has ``select_backward``, which
onnxscript writes as a ``ScatterElements`` one element at a time (2.5-3.8 ms for an ``[8, 128, 8,
3, 32]`` gradient; 34 ms of a tiny BLOOM's 141 ms kernel time): the gradient with the dimension
given back, padded. Rewritten where the step is 1 and the bounds (the index) are known:
``dim``'s size, ``start`` and ``end`` are numbers (negative ones and ``end`` past the size
normalized as PyTorch does) with ``start <= end``.
"""

from __future__ import annotations

import torch

from ortrain.export.spelled_out_math import call_with_value, rewrite_nodes

aten = torch.ops.aten


def copy_slice_backwards(gm: torch.fx.GraphModule) -> int:
    """Rewrite each eligible ``aten.slice_scatter``, ``aten.slice_backward`` and
    ``aten.select_backward`` of ``gm``; returns how many."""
    return rewrite_nodes(gm, _as_copies)


def _bounds(node: torch.fx.Node) -> tuple[int, int, int] | None:
    """(dim, start, end), normalized against the base's size; None where not all are numbers."""
    base, _src, *rest = node.args
    names = ("dim", "start", "end", "step")
    given = dict(zip(names, rest, strict=False)) | {k: v for k, v in node.kwargs.items() if k in names}
    value = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or given.get("step", 1) != 1:
        return None
    dim = given.get("dim", 0)
    if not isinstance(dim, int):
        return None
    dim %= value.dim()
    bounds = _normalized(value.shape[dim], given.get("start"), given.get("end"))
    return None if bounds is None else (dim, *bounds)


def _normalized(size: object, start: object, end: object) -> tuple[int, int] | None:
    """``start`` and ``end`` clamped into ``[0, size]`` as PyTorch's slicing does."""
    start = 0 if start is None else start
    end = size if end is None else end
    if not all(isinstance(v, int) for v in (size, start, end)):
        return None
    assert isinstance(size, int) and isinstance(start, int) and isinstance(end, int)
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, 0), size)
    return (start, end) if start <= end else None


def _padding(node: torch.fx.Node) -> torch.fx.Node | None:
    """``slice_backward(grad, sizes, dim, start, end, 1)``: ``grad`` padded with zeros."""
    if len(node.args) != 6:
        return None
    grad, sizes, dim, start, end, step = node.args
    value = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or step != 1 or not isinstance(dim, int):
        return None
    dim %= value.dim()
    bounds = _normalized(sizes[dim], start, end)
    if bounds is None:
        return None
    before, after = bounds[0], sizes[dim] - bounds[1]
    # constant_pad_nd's list runs from the last dimension backwards, two numbers each.
    pad = [0, 0] * (value.dim() - 1 - dim) + [before, after]
    return _with_the_value_of(node, aten.constant_pad_nd.default, (grad, pad, 0.0))


def _with_the_value_of(node: torch.fx.Node, target: object, args: tuple[object, ...]) -> torch.fx.Node:
    """A ``target(*args)`` node that stands for ``node``, with ``node``'s own value: running the
    operator on fake values with symbolic sizes checked them against their hints and added guards
    (``Eq(s49, 4)``): until wave 42 a graph of a fused query-key-value model was specialized to
    the length it was captured at, and every new sequence length captured again."""
    padded = node.graph.call_function(target, args)
    padded.meta["val"] = node.meta["val"]
    return padded


def _select_padding(node: torch.fx.Node) -> torch.fx.Node | None:
    """``select_backward(grad, sizes, dim, index)``: ``grad`` given the dimension back, padded."""
    if len(node.args) != 4:
        return None
    grad, sizes, dim, index = node.args
    value = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(dim, int) or not isinstance(index, int):
        return None
    dim %= len(sizes)
    size = sizes[dim]
    if not isinstance(size, int) or not -size <= index < size:
        return None
    index %= size
    widened = node.graph.call_function(aten.unsqueeze.default, (grad, dim))
    widened.meta["val"] = value.unsqueeze(dim)  # a view's metadata: no size is compared
    pad = [0, 0] * (len(sizes) - 1 - dim) + [index, size - 1 - index]
    return _with_the_value_of(node, aten.constant_pad_nd.default, (widened, pad, 0.0))


def _as_copies(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op != "call_function":
        return None
    if node.target is aten.slice_backward.default:
        return _padding(node)
    if node.target is aten.select_backward.default:
        return _select_padding(node)
    if node.target is not aten.slice_scatter.default or len(node.args) < 2:
        return None
    bounds = _bounds(node)
    if bounds is None:
        return None
    dim, start, end = bounds
    base, src = node.args[0], node.args[1]
    fake_mode = getattr(node.meta["val"], "fake_mode", None)
    size = base.meta["val"].shape[dim]
    pieces = []
    if start > 0:
        pieces.append(
            call_with_value(node.graph, aten.slice.Tensor, (base, dim, 0, start), fake_mode=fake_mode)
        )
    pieces.append(src)
    if end < size:
        pieces.append(
            call_with_value(node.graph, aten.slice.Tensor, (base, dim, end, size), fake_mode=fake_mode)
        )
    if len(pieces) == 1:
        return None  # the whole tensor: a copy of src, which the translation handles as it is
    return _with_the_value_of(node, aten.cat.default, (pieces, dim))
