"""Outputs that share memory with other outputs, made views of them again after the call's node.

A forward may return a tensor and views of it (``h`` and ``h[:, :2]``, a pooled first row next to
the sequence, ``h.t()``), or one tensor twice. In eager PyTorch such outputs share their autograd
history as well as their memory: writing into one (``out["first"].mul_(2)``) changes the other,
and the gradient of a loss on the other goes through the write. The captured call returns its
outputs from one autograd node (:mod:`ortrain.ortmodule.second_order`), each a separate result of
it: until wave 36 they shared memory and not history, and the gradient missed the write, silently.

So after the node, each such output is made again from the output whose memory holds it, as a
view with its size, strides and storage offset (``as_strided``: whatever view functions made it),
and one tensor returned twice is returned as one tensor. Outputs whose memory no other output
holds are left alone (views of a tensor the forward does not return: writing into one changes
nothing another output shows).

Outputs that are an input of the call, a parameter or a buffer, or views of one (``return h, x``,
``x[0]``, ``self.linear.weight``), are handed back as that tensor itself, or a view of it made
after the node (:func:`input_aliases`, :func:`from_inputs`): the captured call runs on detached
aliases of its tensors, so until wave 42 such an output shared the input's memory and not its
history. A write into it (or into the input) changed both values and only one gradient
(an embedding's gradient 2× off, silently), and a returned parameter came back as a non-leaf
that accepted the in-place writes eager refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ortrain.capture.view_replay import ViewReplay, view_bits, view_replay


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The elements of ``t``'s storage it reaches, as [first, last] offsets."""
    last = t.storage_offset() + sum(
        (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)
    )
    return t.storage_offset(), last


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers every element of its span once (a base, not a strided view of one)."""
    first, last = _span(t)
    return last - first + 1 == t.numel() and t.numel() > 0


# Where an aliased output lies in its holder's memory: size, strides, storage offset; None where it
# is the holder itself, returned twice; a view replay where the view changes the dtype or carries a
# conj/neg bit, which a layout does not say (ortrain/capture/view_replay.py).
Layout = tuple[torch.Size, tuple[int, ...], int] | ViewReplay | None


def _remade(holder: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout is None:
        return holder
    return layout(holder) if callable(layout) else holder.as_strided(*layout)


def output_aliases(outputs: Sequence[Any]) -> dict[int, tuple[int, Layout]]:
    """Output position -> (the position of the output whose memory holds it, its layout there),
    for each output returned twice, or a differentiable view of another output or of what it views
    (a view that does not require grad, ``h.detach()``, has no history to share: left alone)."""
    aliases: dict[int, tuple[int, Layout]] = {}
    first_place: dict[int, int] = {}
    by_storage: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or o.layout != torch.strided or o.numel() == 0:
            continue
        if id(o) in first_place:
            aliases[i] = (first_place[id(o)], None)
            continue
        first_place[id(o)] = i
        by_storage.setdefault(o.untyped_storage().data_ptr(), []).append((i, o))
    for sharing in by_storage.values():
        if len(sharing) < 2:
            continue
        # A holder: a dense output. Of two dense outputs over the same elements (``h`` and
        # ``h.t()``), the first holds, and the other is made a view of it (they share history).
        holders = [(j, holder, _span(holder)) for j, holder in sharing if _dense(holder)]
        for i, o in sharing:
            if not o.requires_grad:
                continue
            first, last = _span(o)
            dense = last - first + 1 == o.numel()
            for j, holder, (held_first, held_last) in holders:
                if j == i:
                    continue
                if view_bits(holder) != view_bits(o):  # ``z`` beside ``z.real`` or ``z.conj()``
                    replay = view_replay(o, holder)
                    if replay is not None and holder.requires_grad:
                        aliases[i] = (j, replay)
                        break
                    continue
                if not held_first <= first <= last <= held_last:
                    continue
                if not holder.requires_grad:
                    # ``x[:, :3]`` next to ``x.detach().view(-1)``: made from the detached one, the
                    # view lost its history, and the input's gradient through it (wave 45's review).
                    continue
                if (held_first, held_last) == (first, last) and dense and j > i:
                    continue  # ``o`` holds the same elements, and comes first: it is the holder
                aliases[i] = (j, (o.shape, o.stride(), o.storage_offset()))
                break
    return aliases


def as_views(returned: Sequence[Any], aliases: dict[int, tuple[int, Layout]]) -> tuple[Any, ...]:
    """``returned`` (the node's results) with each aliased output made again from its holder's
    result: the same tensor, or a view of it laid out as the call's output was."""
    result = list(returned)
    for i, (j, layout) in aliases.items():
        result[i] = _remade(result[j], layout)
    return tuple(result)


# Output position -> (the position in ``tensors`` whose memory it is, its layout there or None
# where it is laid out as that tensor, whether the output requires grad).
InputAliases = dict[int, tuple[int, Layout, bool]]


def input_aliases(outputs: Sequence[Any], passed: Sequence[torch.Tensor]) -> InputAliases:
    """The outputs that are the call's tensors or views of them (see :data:`InputAliases`), given
    ``passed``, the tensors the captured call ran on (aliases of the node's tensors, position by
    position); a detached one (``x.detach()``) is detached again. (The captured call never returns
    memory of its own in an input's storage: ONNX Runtime copies a graph output that is a graph
    input, so sharing means AOTAutograd made the output as a view of the input.)

    The output's source is found by identity first (the tensor itself, or the base AOTAutograd
    made the view of), then, for a view of a view, among the tensors whose memory holds it: two
    inputs over one storage (``m(base[:, :4], base[:, 4:])``, ``m(x.detach(), x)``) must not be
    mistaken for each other (wave 42's second reading: a gradient lost)."""
    position = {id(t): k for k, t in enumerate(passed)}
    holders: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for k, t in enumerate(passed):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() > 0:
            holders.setdefault(t.untyped_storage().data_ptr(), []).append((k, t))
    found: InputAliases = {}
    for i, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or o.layout != torch.strided or o.numel() == 0:
            continue
        layout = (o.shape, o.stride(), o.storage_offset())
        k = position.get(id(o), position.get(id(o._base)) if o._base is not None else None)
        if k is not None and view_bits(o) != view_bits(passed[k]):
            replay = view_replay(o, passed[k])
            if replay is not None:
                found[i] = (k, replay, o.requires_grad)
            continue
        if k is None:
            first, last = _span(o)
            candidates = [
                (j, t)
                for j, t in holders.get(o.untyped_storage().data_ptr(), ())
                if view_bits(t) == view_bits(o) and _span(t)[0] <= first and last <= _span(t)[1]
            ]
            # The same layout first, then the same requires_grad (``x.detach()`` next to ``x``).
            candidates.sort(
                key=lambda c: ((c[1].shape, c[1].stride(), c[1].storage_offset()) != layout,
                               c[1].requires_grad != o.requires_grad)
            )  # fmt: skip
            if not candidates:
                continue
            k = candidates[0][0]
        t = passed[k]
        same = layout == (t.shape, t.stride(), t.storage_offset())
        found[i] = (k, None if same else layout, o.requires_grad)
    return found


def from_inputs(
    returned: Sequence[Any], aliases: InputAliases, tensors: Sequence[torch.Tensor]
) -> tuple[Any, ...]:
    """``returned`` with each output of :func:`input_aliases` made again from the tensor itself."""
    result = list(returned)
    for i, (k, layout, requires_grad) in aliases.items():
        source = tensors[k] if requires_grad or not tensors[k].requires_grad else tensors[k].detach()
        result[i] = _remade(source, layout)
    return tuple(result)
