"""An :class:`ExportedGraph` as bytes and back, for ``ORTMODULE_CACHE_DIR``.

Layout: 8-byte big-endian length of a JSON description (input positions, output plan, size
symbols), the JSON, then the serialized ONNX model. Size formulas are sympy expressions kept as
``sympy.srepr`` strings, which keep the symbols' assumptions (integer, positive) so that the
formulas and ``symbol_sources`` name the same symbols again. Reading them back evaluates them with
``sympy.sympify``: a cache directory must be as trusted as the code that runs.
"""

from __future__ import annotations

import json
from typing import Any

import onnx
import sympy

from ortrain.export.fx_to_onnx import ExportedGraph, OutputSource


def _expr_out(expr: sympy.Expr | None) -> str | None:
    return None if expr is None else sympy.srepr(expr)


def _expr_in(text: str | None) -> sympy.Expr | None:
    return None if text is None else sympy.sympify(text)


def exported_graph_to_bytes(exported: ExportedGraph) -> bytes:
    description = {
        "input_positions": exported.input_positions,
        "outputs": [
            {
                "kind": o.kind,
                "index": o.index,
                "expr": _expr_out(o.expr),
                "from_input": o.from_input,
                "shape": [sympy.srepr(s) for s in o.shape],
            }
            for o in exported.outputs
        ],
        "symbol_sources": [[sympy.srepr(s), p, d] for s, (p, d) in exported.symbol_sources.items()],
    }
    text = json.dumps(description).encode()
    return len(text).to_bytes(8, "big") + text + exported.model.SerializeToString()


def exported_graph_from_bytes(data: bytes) -> ExportedGraph:
    length = int.from_bytes(data[:8], "big")
    description: dict[str, Any] = json.loads(data[8 : 8 + length])
    model = onnx.ModelProto()
    model.ParseFromString(data[8 + length :])
    outputs = [
        OutputSource(
            o["kind"],
            index=o["index"],
            expr=_expr_in(o["expr"]),
            from_input=o["from_input"],
            shape=tuple(sympy.sympify(s) for s in o["shape"]),
        )
        for o in description["outputs"]
    ]
    sources = {sympy.sympify(s): (p, d) for s, p, d in description["symbol_sources"]}
    return ExportedGraph(model, list(description["input_positions"]), outputs, sources)
