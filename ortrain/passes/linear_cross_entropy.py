"""A linear layer feeding cross-entropy: loss and gradients in the forward, chunk by chunk.

``cross_entropy(linear(x, W, b).view(-1, V), target)`` (a language model's head and loss) makes
(rows x vocabulary) tensors that dominate a small model's memory: the logits, their log-softmax
(saved for the backward) and, in the backward, the logits' gradient. The loss is a scalar at the
end of the forward, so its gradients with respect to ``x``, ``W`` and ``b`` are known once it is
computed, up to the one number the backward brings (the loss's own gradient ``g``, 1 for a plain
``loss.backward()``, the loss scale under mixed precision):

    A  = (softmax(z) - (1 - eps) * onehot(target) - eps / V) * counted / count   (z = x W^T + b)
    dx = g * A W      dW = g * A^T x      db = g * sum(A, rows)

(``A`` is not formed as such: see the loop in :func:`linear_cross_entropy`.)

This pass replaces the loss by :func:`linear_cross_entropy`, which computes the loss and ``A W``,
``A^T x``, ``sum(A)`` in row chunks of at most ``CHUNK_BYTES`` of logits, and returns
``loss + (s - detach(s))`` with ``s = sum(x * detach(A W)) + sum(W * detach(A^T x)) + ...``: the
value is the loss exactly (``s - s`` is 0), and autograd's gradient of ``s`` is ``g`` times the
precomputed gradients. What crosses from forward to backward is ``A W`` (rows x d) and ``A^T x``
(V x d) instead of a (rows x V) log-softmax; no (rows x V) tensor exists in the backward, and the
forward's is one chunk at a time. No matmul is added: the forward does the three products the
backward did (eager's backward computes the same ``A``), and nothing is recomputed.

With label sparsity on (``ORTMODULE_ENABLE_SPARSE_OPTIMIZER``) ignored labels cost no matmul, in
one of two ways. At memory optimizer level 0 the gather of counted rows is written into the graph
before the call (as :mod:`ortrain.passes.label_sparsity` does), where the compute optimizer can
move it further up (the last layer's MLP then runs on counted rows too); the counted rows form
one chunk, since their number is known only at run time. At level 1 and above, or when the logits
are also returned (``(logits, loss)`` models: the linear layer stays for that output and the loss
reads its rows instead of multiplying again), each fixed-size chunk gathers its own counted rows,
so that no more than a chunk of logits exists at once. Chunking needs a fixed number of rows; a
dynamic (symbolic) row count runs as one chunk, which still stashes nothing of size rows x V.

Matched: ``cross_entropy`` with ``weight=None``, reduction ``mean`` or ``sum``, any
``ignore_index`` and ``label_smoothing``, on 2-D float32 logits that are views of a ``linear``'s
output. Other losses are left to the label-sparsity and compute-optimizer rewrites.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import torch

from ortrain.passes.label_density import dense_reason, sparse_enough
from ortrain.passes.label_sparsity import gather_counted_rows
from ortrain.passes.rowwise import value

logger = logging.getLogger("ortrain.passes")

aten = torch.ops.aten

CHUNK_BYTES = 64 * 2**20  # logits per chunk: at most this many bytes of (rows x vocabulary)

_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
_CONVERSIONS = frozenset({aten.to.dtype, aten._to_copy.default})
_MEAN, _SUM = 1, 2


def _chunk_rows(rows: int | torch.SymInt, classes: int) -> list[int] | None:
    """Row counts of the chunks, or None for one chunk (a symbolic row count is not split)."""
    if not isinstance(rows, int) or not isinstance(classes, int):
        return None
    per_chunk = max(1, CHUNK_BYTES // (4 * max(classes, 1)))
    if rows <= per_chunk:
        return None
    count = math.ceil(rows / per_chunk)
    size = math.ceil(rows / count)
    return [size] * (rows // size) + ([rows % size] if rows % size else [])


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logits: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
    sparse: bool,
) -> torch.Tensor:
    """``cross_entropy(linear(x, weight, bias), target)`` with its gradients computed here.

    ``logits``: the linear layer's output when the model returns it too (its rows are read rather
    than recomputed), else None. ``sparse``: keep each chunk's counted rows only.
    """
    classes = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    z2 = None if logits is None else logits.reshape(-1, classes)
    labels = target.reshape(-1)
    wanted = [t is not None and t.requires_grad and torch.is_grad_enabled() for t in (x2, weight, bias)]
    xd, wd = x2.detach(), weight.detach()
    zd = None if z2 is None else z2.detach()
    bd = None if bias is None else bias.detach()

    sizes = _chunk_rows(x2.shape[0], classes)

    # (start, rows) of each chunk. Each chunk's rows are sliced inside the loop, right before its
    # work: ONNX's Split writes every chunk at once, and ONNX Runtime runs the graph in its order,
    # so a split of returned logits was a second rows x V copy alive for the whole loop (tiny GPT,
    # batch 32, seq 512: 500 MiB of the last forward region's 1.1 GiB).
    if sizes is None:
        bounds = [(0, x2.shape[0])]
    else:
        bounds = list(zip(itertools.accumulate([0, *sizes[:-1]]), sizes, strict=True))

    def rows(t: torch.Tensor | None, start: Any, count: Any) -> Any:
        return t if t is None or sizes is None else t.narrow(0, start, count)

    total = xd.new_zeros(())
    count = labels.ne(ignore_index).sum()
    scale = 1.0 / count.clamp(min=1).to(xd.dtype) if reduction == _MEAN else None
    grad_x: list[torch.Tensor] = []
    # Each sum starts from its first chunk, not from zeros: a (V x d) fill and addition less.
    grad_w: torch.Tensor | None = None
    grad_b: torch.Tensor | None = None
    for start, count_rows in bounds:
        xc, tc = rows(xd, start, count_rows), rows(labels, start, count_rows)
        zc = rows(zd, start, count_rows)
        index = None
        if sparse:
            index = tc.ne(ignore_index).nonzero().view(-1)
            xc_rows, tc = xc.index_select(0, index), tc.index_select(0, index)
            zc = zc.index_select(0, index) if zc is not None else torch.nn.functional.linear(xc_rows, wd, bd)
        else:
            xc_rows = xc
            zc = zc if zc is not None else torch.nn.functional.linear(xc, wd, bd)
        counted = tc.ne(ignore_index)
        safe = tc.masked_fill(~counted, 0).unsqueeze(1)
        # log_softmax, not logsumexp: the latter's reference guards on an empty input, which a
        # data-dependent (counted) row count cannot answer
        logp = zc.log_softmax(1)
        row_loss = -(1 - label_smoothing) * logp.gather(1, safe).squeeze(1)
        if label_smoothing:
            row_loss = row_loss - label_smoothing * logp.mean(1)
        total = total + row_loss.masked_fill(~counted, 0).sum()
        if not any(wanted):
            continue
        # A = (softmax - eps / V - (1 - eps) onehot) * row_scale, with row_scale 1/count (or 1) on
        # counted rows and 0 on the others. A itself is never formed: its one-hot, its constant and
        # its row scale go into the products' (rows x d), (V x d) and (V,) terms, which leaves one
        # pass over the (rows x V) softmax instead of three (HF GPT-2 with vocabulary 8000, 1016
        # rows: 18 ms a step less on a 2-core Intel Xeon).
        softmax = logp.exp()
        row_scale = counted.to(softmax.dtype) if scale is None else counted.to(softmax.dtype) * scale
        hit, spread = 1 - label_smoothing, label_smoothing / classes
        targets = safe.squeeze(1)
        if wanted[0]:
            rows_grad = softmax @ wd - hit * wd.index_select(0, targets)
            if spread:
                rows_grad = rows_grad - spread * wd.sum(0)
            rows_grad = rows_grad * row_scale.unsqueeze(1)
            if index is not None:
                rows_grad = xc.new_zeros(xc.shape).index_copy(0, index, rows_grad)
            grad_x.append(rows_grad)
        # The one-hot term is taken off the product's target rows in place (index_add with alpha),
        # not scattered into a (V x d) tensor of zeros, scaled and subtracted: three passes over
        # the head's size less per chunk.
        if wanted[1]:
            scaled_x = xc_rows * row_scale.unsqueeze(1)
            chunk_w = (softmax.t() @ scaled_x).index_add(0, targets, scaled_x, alpha=-hit)
            if spread:
                chunk_w = chunk_w - spread * scaled_x.sum(0)
            grad_w = chunk_w if grad_w is None else grad_w + chunk_w
        if wanted[2] and bd is not None:
            chunk_b = (row_scale @ softmax).index_add(0, targets, row_scale, alpha=-hit)
            if spread:
                chunk_b = chunk_b - spread * row_scale.sum()
            grad_b = chunk_b if grad_b is None else grad_b + chunk_b
    loss = total if scale is None else total / count.to(total.dtype)
    if not any(wanted):
        return loss
    # s - detach(s) is exactly 0 and carries the precomputed gradients (times the loss's gradient)
    terms = []
    if wanted[0]:
        terms.append((x2 * torch.cat(grad_x)).sum())
    if grad_w is not None:
        terms.append((weight * grad_w).sum())
    if grad_b is not None and bias is not None:
        terms.append((bias * grad_b).sum())
    carrier = torch.stack(terms).sum()
    # Selected, not multiplied, when no label counts: with the Trainer's sum divided by
    # ``num_items_in_batch`` = 0 the loss's gradient is inf, and inf times the zero gradients made
    # every gradient of the model NaN (wave 42), where eager's nll_loss backward writes zeros.
    return loss + torch.where(count > 0, carrier - carrier.detach(), torch.zeros_like(carrier))


def _loss_arguments(node: torch.fx.Node) -> tuple[Any, int, int, float]:
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    defaults = (None, _MEAN, -100, 0.0)
    found = []
    for position, (name, default) in enumerate(zip(names, defaults, strict=True), start=2):
        found.append(node.args[position] if len(node.args) > position else node.kwargs.get(name, default))
    return found[0], found[1], found[2], found[3]


def _same_dtype_conversion(node: torch.fx.Node) -> bool:
    """``logits.float()`` on float32 logits (Hugging Face's losses upcast): no conversion at all."""
    if node.target not in _CONVERSIONS:
        return False
    out, source = value(node), value(node.args[0])
    return out is not None and source is not None and out.dtype == source.dtype


def _linear_through_views(node: Any) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The ``linear`` node whose output ``node`` views, and the view nodes in between."""
    views = []
    while (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and (node.target in _VIEWS or _same_dtype_conversion(node))
    ):
        views.append(node)
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.linear.default:
        return node, views
    return None


def fuse_linear_cross_entropy(gm: torch.fx.GraphModule, *, sparse: bool, chunked_gathers: bool) -> list[str]:
    """Replace each eligible ``linear`` + ``cross_entropy`` by :func:`linear_cross_entropy`.

    ``sparse``: ignored labels are dropped (label sparsity), where the captured batch ignores
    enough of them (:mod:`ortrain.passes.label_density`). ``chunked_gathers``: each chunk gathers
    its own counted rows (bounded memory) rather than one gather before the head (fewer FLOPs
    upstream, through the compute optimizer).
    """
    graph = gm.graph
    changes = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
            continue
        weight, reduction, ignore_index, label_smoothing = _loss_arguments(node)
        found = _linear_through_views(node.args[0])
        logits, target = value(node.args[0]), value(node.args[1])
        if (
            found is None
            or weight is not None
            or reduction not in (_MEAN, _SUM)
            or not isinstance(ignore_index, int)
            or not isinstance(label_smoothing, (int, float))
            or logits is None
            or target is None
            or logits.dim() != 2
            or target.dim() != 1
            or logits.dtype != torch.float32
            # int32 labels: PyTorch's loss refuses them, and so must the capture (the NLL
            # decomposition does: capture/decompositions_losses.py); uint8 ones go that way too.
            or target.dtype != torch.int64
        ):
            continue
        linear, views = found
        x, w = linear.args[0], linear.args[1]
        b = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        if value(x) is None or value(x).dtype != torch.float32 or value(w) is None or value(w).dim() != 2:
            continue
        # Each row of logits one row of the head's input: a head of K x V outputs viewed as K rows
        # of V classes (multi-token prediction) is not this loss (wave 41: fused, it trained on a
        # softmax over K x V classes, loss 4.73 where eager gave 4.03).
        if str(logits.shape[-1]) != str(value(w).shape[0]):
            continue
        # The logits stay only where something besides this loss reads them (a returned output).
        loss_chain = {node, *views}
        others = [u for v in (linear, *views) for u in v.users if u not in loss_chain]
        logits_arg = linear if others else None
        target = node.args[1]
        sparse_here, density = sparse_enough(target, ignore_index) if sparse else (False, None)
        if sparse and not sparse_here:
            logger.info("label sparsity: %s left dense (%s)", node.name, dense_reason(density))
        gather_first = sparse_here and not others and not chunked_gathers
        with graph.inserting_before(node):
            if gather_first:  # the gather label sparsity writes, which the compute optimizer can move
                # A reshape: the head's input may be a transposed view (a sequence-first model).
                rows = graph.call_function(aten.reshape.default, (x, [-1, value(x).shape[-1]]))
                # the compute optimizer reads the selected tensor's shape off its meta
                rows.meta["val"] = value(x).reshape(-1, value(x).shape[-1])
                x, target = gather_counted_rows(graph, rows, target, ignore_index)
            chunk_sparse = sparse_here and not gather_first
            smoothing = float(label_smoothing)
            arguments = (x, w, b, logits_arg, target, reduction, ignore_index, smoothing, chunk_sparse)
            fused = graph.call_function(linear_cross_entropy, arguments)
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        for dead in (*views, linear):  # now unread, unless returned: later rewrites see x's real users
            if not dead.users:
                graph.erase_node(dead)
        how = "on the counted rows, in one chunk" if gather_first else "chunk by chunk"
        if chunk_sparse:
            how += ", each chunk's counted rows"
        changes.append(
            f"linear cross-entropy: {linear.name} and its loss now compute the gradients in the forward"
            f", {how}{' (logits returned, read not recomputed)' if others else ''}"
        )
        logger.info("%s", changes[-1])
    return changes
