"""An ExportedGraph survives the cache's bytes: every output kind, formulas with their symbols."""

from __future__ import annotations

import onnx
import sympy

from ortrain.export.exported_graph_io import exported_graph_from_bytes, exported_graph_to_bytes
from ortrain.export.fx_to_onnx import ExportedGraph, OutputSource


def test_round_trip_keeps_plans_and_symbol_assumptions() -> None:
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    outputs = [
        OutputSource("onnx", index=0),
        OutputSource("view", index=2, shape=(s0 * 2, sympy.Integer(3)), from_input=True),
        OutputSource("size", expr=s0 + 1),
        OutputSource("output_size", index=1, dim=0),
        OutputSource("same", index=0),
        OutputSource("none"),
    ]
    exported = ExportedGraph(model, [1, 0], outputs, {s0: (0, 1)})
    loaded = exported_graph_from_bytes(exported_graph_to_bytes(exported))
    assert loaded.outputs == outputs and loaded.input_positions == [1, 0]
    assert loaded.symbol_sources == {s0: (0, 1)}
    assert loaded.outputs[2].expr.free_symbols == {s0}  # the same symbol, assumptions included
    assert loaded.model == model
