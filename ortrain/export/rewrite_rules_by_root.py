"""onnxscript's optimizer with each default rewrite rule tried only on nodes of its root operator.

``torch.onnx.export(optimize=True)`` (and ortrain's node-by-node translation, which runs the same
optimizer) tries every one of onnxscript's default rewrite rules on every node, twice. A rule
whose pattern has several output nodes (``SlicesSplit``: two Slices of one tensor) rebuilds a
table of the whole graph's nodes for every node it is tried on, so that rule alone is quadratic
in the graph's size: the rewrite pass took 0.9 s of the tiny GPT's backward graph, 2.5 s of its
dynamic-shape backward (1 600 nodes; 2-core AMD EPYC).

Every such match starts by comparing the node's operator and domain with those of the pattern's
first output node, and fails at once when they differ. Doing that comparison before the matcher
runs skips only matches that would have failed, so the rules rewrite exactly the same nodes in the
same order: the optimized models are byte-identical (``tests/export/test_rewrite_rules_by_root.py``
checks it on the tiny GPT's graphs). While ortrain exports, onnxscript's default rule list is
swapped for these filtered copies of the same rules (exports are serialized by ortrain's compile
lock); a rule whose root operator is itself a pattern, or whose matcher is not onnxscript's plain
one, is kept as it is.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import Any

from onnxscript import rewriter
from onnxscript.rewriter import _matcher

from ortrain.export.exact_constant_patterns import adds_zero, with_exact_constants


def _filtered(rule: Any) -> Any:
    matcher = getattr(rule, "_matcher", None)
    if type(matcher) is not _matcher.SimplePatternMatcher or not matcher.pattern.output_nodes:
        return rule
    root = matcher.pattern.output_nodes[0].op_identifier()
    if root is None:  # the operator or the domain is a pattern, not a name
        return rule
    domain, op_type, _overload = root  # a match compares the operator and domain, not the overload
    filtered = copy.copy(rule)  # shares the pattern, the replacement and the condition
    try_rewrite = filtered.try_rewrite

    # Checked before the rule builds anything: the rewrite pass makes ~120 000 tries on the tiny
    # GPT's two graphs, and a failed match object with its message cost 2 µs a try.
    def try_rewrite_on_root(
        model: Any, graph_or_function: Any, node: Any, *, verbose: int | None = None, tracer: Any = None
    ) -> Any:
        # A tracer records every failed attempt: give it the rule's own.
        if tracer is None and (node.op_type != op_type or node.domain != domain):
            return None
        return try_rewrite(model, graph_or_function, node, verbose=verbose, tracer=tracer)

    filtered.try_rewrite = try_rewrite_on_root
    return filtered


# onnxscript's fusions of Min, Max, Clip and Relu chains name the bounds they make "<input>_min" and
# "<input>_max": a tensor clamped twice (a binary network's weights, ``clamp(w, -1, 1) + (sign(w)
# - clamp(w, -1, 1)).detach()``) got a second pair renamed "_min_1" but never added to the graph,
# which ONNX Runtime refused as invalid (wave 48's review; torch.onnx.export fails alike). Left out.
_NAMING_BOUNDS = frozenset(
    {
        "FuseSuccessiveMin",
        "FuseSuccessiveMax",
        "FuseMinMaxToClip",
        "FuseMaxMinToClip",
        "FuseSuccessiveClip",
        "FuseSuccessiveClipRelu",
        "FuseSuccessiveReluClip",
    }
)
# onnxscript's ScatterAllStatic replaces a ScatterND whose constant indices cover the whole first
# axis by its updates, whatever its reduction: an index_add at ``arange(n)`` (cross-entropy's
# one-hot term at targets ``arange(batch) % classes`` with batch = classes, in
# passes/linear_cross_entropy.py) lost every value it added to, the softmax part of the gradient
# gone (wave 49's review). Left out; its dynamic sibling matches reduction "none" only.
_IGNORING_REDUCTION = frozenset({"ScatterAllStatic"})
_LEFT_OUT = _NAMING_BOUNDS | _IGNORING_REDUCTION


@functools.cache
def _filtered_rules(rules: tuple[Any, ...]) -> tuple[Any, ...]:
    # and their constants matched exactly: see exact_constant_patterns
    return tuple(
        _filtered(with_exact_constants(rule))
        for rule in rules
        if not adds_zero(rule) and getattr(rule, "name", None) not in _LEFT_OUT
    )


@contextlib.contextmanager
def rewrite_rules_tried_by_root_operator() -> Iterator[None]:
    """While exporting: onnxscript's default rewrite rules, each tried only on its root operator
    and matching its constants exactly."""
    original = rewriter._DEFAULT_REWRITE_RULES
    filtered = _filtered_rules(original)
    rewriter._DEFAULT_REWRITE_RULES = filtered
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = original
        _forget_last_matches(filtered)


# What an onnxscript matcher keeps of its last match: the graph it matched in, the node, the
# bindings. The default rules are module-level objects, so each kept the last graph exported
# (every node, every constant: the tiny T5's two graphs, 6.6 MiB of constants alone) alive for
# the life of the process (wave 41).
_LAST_MATCH = ("_graph", "_current_node", "_match", "_tracer")


def _forget_last_matches(rules: tuple[Any, ...]) -> None:
    for rule in rules:
        matcher = getattr(rule, "_matcher", None)
        for name in _LAST_MATCH:
            if name in getattr(matcher, "__dict__", {}):
                setattr(matcher, name, None)
