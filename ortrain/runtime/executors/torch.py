"""The torch executor: runs a region's FX nodes in PyTorch. It claims every node, so it is the
universal last resort (and, for a whole graph, the reference the other executors match)."""

from __future__ import annotations

from typing import Any

import torch

from ortrain.capture.lazy_recompile import graph_module
from ortrain.capture.view_ops import VIEWS, views_as_reshapes
from ortrain.runtime.executors.base import Runner
from ortrain.runtime.inplace_scatter import scatter_in_place
from ortrain.runtime.random_op_layouts import with_random_op_layouts
from ortrain.runtime.recorded_input_layouts import RecordedInputLayouts


class TorchExecutor:
    name = "torch"
    merges = True

    def claims(self, node: torch.fx.Node) -> bool:
        return True

    def refusal(self, node: torch.fx.Node) -> str | None:
        return None

    def build(self, region: torch.fx.GraphModule, *, what: str, whole: bool) -> Runner:
        given = region
        region = scatter_in_place(region)
        if region is given and any(n.op == "call_function" and n.target in VIEWS for n in given.graph.nodes):
            # The edit below goes to a copy: ``given`` may be a whole graph that another placement
            # exports later (op tuning builds its default lazily; wave 43 found the views of such a
            # graph turned into reshapes by the time its export read it).
            graph = torch.fx.Graph()
            graph.output(graph.graph_copy(given.graph, {}))
            region = graph_module(given, graph)
        # A view becomes a reshape, which is the same view where the strides allow one and a copy
        # where they do not. Values from other executors are contiguous where the capture may
        # have seen strides (ONNX Runtime returns a transpose as a copy), and even a whole graph
        # can meet strides other than the traced ones: PyTorch's CPU kernel of
        # `_native_batch_norm_legit_functional` returns a transposed input's output contiguous
        # where its fake kernel keeps the input's strides, so the view that transposes it back
        # failed (PatchTST: "view size is not compatible with input tensor's size and stride").
        views_as_reshapes(region.graph)
        region.recompile()
        if not whole:
            # For the first reason a random operator gets its inputs back in the captured layout (it
            # draws in memory order), and so does a determinant (the factors its backward reads
            # follow its input's layout): see runtime/random_op_layouts.py.
            region = with_random_op_layouts(region)

        # The whole graph's inputs come in the captured strides.
        layouts = RecordedInputLayouts(region) if whole else None

        def run(args: list[Any]) -> list[Any]:
            if layouts is not None:
                args = layouts.restore(args)
            return list(region(*args))

        run.region = region  # type: ignore[attr-defined]
        return run
