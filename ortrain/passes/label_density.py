"""Whether the captured batch ignores enough labels for label sparsity to pay (upstream's rule).

Label sparsity (``label_sparsity.py``, and the fused head and loss of ``linear_cross_entropy.py``)
gathers the counted rows before a loss: a ``NonZero`` and gathers in the forward, scatters in the
backward, and a row count known only at run time, whose symbolic tracing is slow. Where every
label counts (a classifier, a language model trained on every token) that is cost for nothing:
wave 53 measured a small classifier's capture at 1.3 s without it and 4.1 s with it, and such
models were most of what the option touched. ONNX Runtime's ORTModule enabled its label
sparsity only where the first batch's labels were under 90 % dense (its runtime inspector); so
does ortrain, per capture, from the batch the capture is traced with: labels that come from an
input through ops that keep their values (views, slices, shifts, pads) and are under
:data:`SPARSE_BELOW` counted get the gather, and so do labels the model computes (their values
are not known before the trace). Only speed depends on it: either graph gives the dense loss and
gradients for any later batch.
"""

from __future__ import annotations

import torch

from ortrain.capture.forward_rewrite import INPUT_VALUE

aten = torch.ops.aten

SPARSE_BELOW = 0.9  # label density (counted / all) under which the gather is written

# Ops that move or copy index values without computing new ones (argument 0 is the source).
VALUE_PRESERVING = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.clone.default,
        aten.contiguous.default,
        aten._to_copy.default,
        aten.to.dtype,
        aten.to.dtype_layout,
        aten.expand.default,
        aten.flatten.using_ints,
        aten.squeeze.dim,
        aten.unsqueeze.default,
        aten.constant_pad_nd.default,
        aten.pad.default,
        aten.index_select.default,
        aten.alias.default,
    }
)


def source_placeholder(node: object) -> torch.fx.Node | None:
    """The placeholder whose values ``node`` carries through :data:`VALUE_PRESERVING` ops, or None."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 64:
        if node.op == "placeholder":
            return node
        if node.op != "call_function" or node.target not in VALUE_PRESERVING or not node.args:
            return None
        node = node.args[0]
        seen += 1
    return None


def label_density(target: torch.fx.Node, ignore_index: int) -> float | None:
    """Counted labels / all labels of the input ``target`` comes from, on the captured batch;
    None where that is not known (labels computed in the model, a trace without values)."""
    source = source_placeholder(target)
    labels = None if source is None else source.meta.get(INPUT_VALUE)
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        return None
    total = labels.numel()
    return float(labels.ne(ignore_index).sum().item()) / total if total else None


def sparse_enough(target: torch.fx.Node, ignore_index: int) -> tuple[bool, float | None]:
    """Whether to gather the counted rows for a loss over ``target``, and the density it read."""
    density = label_density(target, ignore_index)
    return density is None or density < SPARSE_BELOW, density


def dense_reason(density: float | None) -> str:
    return f"{density:.0%} of the captured batch's labels count; it pays under {SPARSE_BELOW:.0%}"
