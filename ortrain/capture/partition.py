"""Split the joint graph into forward and backward: what crosses between them, and what is recomputed.

AOTAutograd's default partition saves every forward value the backward reads. Two kinds of value
are cheaper to rebuild in the backward graph than to pass across:

- Copies that keep their input's layout are dropped first (see :mod:`ortrain.capture.copy_elision`):
  otherwise a tensor and its copy can both be stashed.
- Reshapes and transposes (``t``, ``view``, ``permute``, ...). Saved as forward outputs, ONNX
  Runtime must materialize each one as a copy; recomputed in the backward graph they cost nothing,
  and a transposed weight folds into the backward ``MatMul`` (measured on the tiny GPT: the
  forward's Transpose/Reshape/Identity kernels, ≈ 20 ms of 150, disappear).
- Checkpointed regions (see :mod:`ortrain.capture.checkpointing`), which is what checkpointing asks.
- The subgraphs the memory optimizer chose (see :mod:`ortrain.capture.memory_optimizer`).

A draw whose result the forward never reads gets a reader first (:func:`read_unread_tuples`),
without which the partition fails.

The backward graph then gets ``log_softmax``'s backward fused with its loss's one-hot gradient
(see :mod:`ortrain.capture.loss_backward`), and additions to a scatter into zeros folded into the
scatter (see :mod:`ortrain.capture.scatter_accumulate`). Last, in both graphs, scatters at positions
that never repeat (padding elimination's real tokens, label sparsity's counted rows: marked on the
joint graph) copy rather than add (see :mod:`ortrain.capture.distinct_index_scatters`).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch._functorch.partitioners import default_partition
from torch.utils.checkpoint import CheckpointPolicy

from ortrain.capture.checkpointing import tag_regions_for_recompute
from ortrain.capture.copy_elision import drop_layout_preserving_clones
from ortrain.capture.distinct_index_scatters import copy_into_distinct_positions, mark_distinct_indices
from ortrain.capture.loss_backward import fuse_log_softmax_backward
from ortrain.capture.memory_optimizer import (
    MemoryOptimizerConfig,
    MemoryReport,
    plan_recompute,
    record_partition,
)
from ortrain.capture.memory_summary import format_summary
from ortrain.capture.scatter_accumulate import fold_additions_into_scatters
from ortrain.capture.view_ops import RELAYOUTS

logger = logging.getLogger("ortrain.capture")
_warned_unread: set[str] = set()


def tag_relayouts_for_recompute(graph: torch.fx.Graph) -> int:
    """Ask the partitioner to rebuild forward reshapes/transposes in the backward; returns how many."""
    tagged = 0
    for node in graph.nodes:
        if (
            node.op == "call_function"
            and node.target in RELAYOUTS
            and node.meta.get("partitioner_tag") == "is_forward"
            and "recompute" not in node.meta
        ):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            tagged += 1
    return tagged


def read_unread_tuples(graph: torch.fx.Graph) -> list[str]:
    """Give each multi-output node nobody reads a reader of its first output; returns what each
    such node is (its target, and the line of the forward that made it when known).

    These are random draws whose result the forward never uses (``dropout(h)`` computed and
    dropped): a random node stays in the joint graph where other unused nodes are removed.
    ``default_partition`` takes a node for a tuple only when every user is a ``getitem`` and there
    is at least one, and failed on such a node ("Expected native_dropout to be a tensor"): the
    model trained in PyTorch. Given a reader, it is then left out of the forward graph, as
    ``torch.compile`` leaves it out.
    """
    unread = []
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if node.op != "call_function" or node.users or not isinstance(value, (tuple, list)) or not value:
            continue
        with graph.inserting_after(node):
            first = graph.call_function(operator.getitem, (node, 0))
        first.meta.update({k: v for k, v in node.meta.items() if k != "val"}, val=value[0])
        trace = (node.meta.get("stack_trace") or "").strip().splitlines()
        unread.append(f"{node.target}" + (f" ({trace[-1].strip()})" if trace else ""))
    return unread


def partition(
    joint: torch.fx.GraphModule,
    joint_inputs: Any,
    *,
    memory: MemoryOptimizerConfig | None = None,
    reports: list[MemoryReport] | None = None,
    **kwargs: Any,
) -> Any:
    """``default_partition`` after tagging what to recompute; the memory report goes to ``reports``."""
    unread = "; ".join(read_unread_tuples(joint.graph))
    if unread and unread not in _warned_unread:  # once, not at each re-capture
        _warned_unread.add(unread)
        logger.warning(
            "the forward computes values it never uses (%s): the captured graph leaves them out, as "
            "torch.compile's graphs do; random draws among them are not drawn, so the draws after "
            "them differ from eager PyTorch's under the same seed (gradients are exact for the "
            "draws used). Remove the unused call to draw what eager draws",
            unread,
        )
    clones = drop_layout_preserving_clones(joint.graph)
    mark_distinct_indices(joint.graph)
    regions = tag_regions_for_recompute(joint.graph)
    relayouts = tag_relayouts_for_recompute(joint.graph)
    logger.debug(
        "dropped %d clones that kept their input's layout; recomputing %d checkpointed nodes and %d "
        "reshapes in the backward",
        clones,
        regions,
        relayouts,
    )
    report = plan_recompute(joint.graph, memory or MemoryOptimizerConfig())
    forward, backward = default_partition(joint, joint_inputs, **kwargs)
    fuse_log_softmax_backward(backward)
    fold_additions_into_scatters(backward)
    for graph_module in (forward, backward):
        copy_into_distinct_positions(graph_module)
    record_partition(report, forward, kwargs["num_fwd_outputs"])
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", format_summary(report))
    if reports is not None:
        reports.append(report)
    return forward, backward
