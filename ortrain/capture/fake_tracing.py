"""Trace a small function on the fake values of graph nodes, and splice the trace into a graph.

Both the export's per-node decompositions (``ortrain.export.direct_translation``) and the
backward-graph rewrites (``ortrain.capture.loss_backward``) replace one node of a captured graph by
the ATen graph of a Python function, traced on that node's inputs' values: fake tensors whose sizes
may be symbolic or data-dependent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx


@contextlib.contextmanager
def no_pending_unbacked_symbols(shape_env: Any) -> Iterator[None]:
    """AOTAutograd leaves the last unbacked size it created (a data-dependent row count, such as
    label sparsity's) pending in its shape environment; a trace would take it for one it created."""
    pending = list(shape_env.pending_fresh_unbacked_symbols)
    shape_env.pending_fresh_unbacked_symbols.clear()
    try:
        yield
    finally:
        shape_env.pending_fresh_unbacked_symbols[:] = pending


def trace_on_values(
    function: Callable[..., Any],
    values: list[Any],
    *,
    decomposition_table: dict[Any, Any] | None = None,
    size_oblivious: bool = False,
    graph: torch.fx.Graph | None = None,
) -> torch.fx.GraphModule:
    """``function`` traced on ``values`` in their own fake mode (constants it creates are fake too).

    ``size_oblivious`` keeps a size of 0 or 1 symbolic, as torch.onnx decomposes. Values without a
    tensor (``eye(n)``'s size alone) are traced in the fake mode of ``graph``'s inputs: in none, a
    symbolic size made a fake mode of its own, which the export then refused to mix with the
    graph's ("fake mode ... doesn't match", wave 44)."""
    fake_mode = detect_fake_mode(values)
    if fake_mode is None and graph is not None:
        fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
            if fake_mode.shape_env is not None:
                stack.enter_context(no_pending_unbacked_symbols(fake_mode.shape_env))
        if size_oblivious:
            stack.enter_context(torch.fx.experimental._config.patch(backed_size_oblivious=True))
        return make_fx(function, decomposition_table=decomposition_table, tracing_mode="real")(*values)


def copy_before(
    graph: torch.fx.Graph, node: torch.fx.Node, traced: torch.fx.GraphModule, inputs: list[torch.fx.Node]
) -> Any:
    """Copy ``traced`` into ``graph`` before ``node``, its placeholders bound to ``inputs``; returns
    what the copy outputs (a node, or a tuple of nodes)."""
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, inputs, strict=True))
    with graph.inserting_before(node):
        return graph.graph_copy(traced.graph, env)
