"""torch.onnx's explicit type promotion, reading each untouched node's value from the graph.

ONNX operators want inputs of one type where ATen promotes (``mul`` of a float and an integer
tensor), so torch.onnx inserts the casts before translating: an FX interpreter walks the graph
under fake tensors, applies the promotion rule of each elementwise operator, and re-runs every
node to know the types the next nodes receive. ortrain's graphs already carry each node's value
(AOTAutograd's, or the traced decomposition's), so re-running the nodes that no rule changes only
recomputes what is there: 0.4 s of the tiny GPT's first step, 0.9 s of its dynamic re-capture
(2-core AMD EPYC), nearly all of the pass.

This runs torch.onnx's own pass and interpreter with one difference: a call that no promotion rule
changes takes its recorded value (``node.meta["val"]``) instead of running again. Nodes the pass
changes or inserts still run, exactly as before, and every decision reads the same types, so the
pass inserts the same casts (``tests/export/test_recorded_type_promotion.py`` compares the
exported models on promoting graphs and the tiny GPT's). A node without a recorded value runs.

torch.onnx's private exporter API is used in this file (and the other files of ``export/``) only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.onnx._internal.fx.passes import type_promotion


class _RecordedValuesInterpreter(type_promotion._TypePromotionInterpreter):
    def run_node(self, n: torch.fx.Node) -> Any:
        recorded = n.meta.get("val")
        if n.op != "call_function" or recorded is None:
            return super().run_node(n)
        before = (n.target, n.args, n.kwargs)
        with self._set_current_node(n):
            if rule := type_promotion.get_type_promotion_rule(n, self.type_promotion_table):
                self._maybe_promote_node(n, rule)
        if (n.target, n.args, n.kwargs) != before:  # promoted: its value was recomputed, run it
            return super(type_promotion._TypePromotionInterpreter, self).run_node(n)
        return recorded


def insert_type_promotion_nodes(graph_module: torch.fx.GraphModule) -> None:
    """What ``torch.onnx``'s ``_fx_passes.insert_type_promotion_nodes`` does to ``graph_module``."""
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            raise TypeError(f"expected a GraphModule, got {type(module).__name__}")
        promotion = type_promotion.InsertTypePromotion(module)
        promotion.interpreter = _RecordedValuesInterpreter(module, promotion.interpreter.type_promotion_table)
        promotion.run()
