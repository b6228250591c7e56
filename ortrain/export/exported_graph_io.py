"""An :class:`ExportedGraph` as bytes and back, for ``ORTMODULE_CACHE_DIR``.

Layout: 8-byte big-endian length of a JSON description (input positions, output plan, size
symbols), the JSON, then the serialized ONNX model. Size formulas are sympy expressions kept as
``sympy.srepr`` strings, which keep the symbols' assumptions (integer, positive) so that the
formulas and ``symbol_sources`` name the same symbols again. Reading them back evaluates them with
``sympy.sympify``: a cache directory must be as trusted as the code that runs.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import onnx
import sympy
import torch

from ortrain.export.fx_to_onnx import ExportedGraph, OutputSource


def _encode(value: Any) -> Any:
    if isinstance(value, sympy.Basic):
        return {"sympy": sympy.srepr(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in the export cache")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "sympy" in value:
            return sympy.sympify(value["sympy"])
        return tuple(_decode(v) for v in value["tuple"])
    return value


def exported_graph_to_bytes(exported: ExportedGraph) -> bytes:
    """Every field of each :class:`OutputSource`, so that fields added later are stored too."""
    description = {
        "input_positions": exported.input_positions,
        "outputs": [
            {f.name: _encode(getattr(o, f.name)) for f in fields(OutputSource)} for o in exported.outputs
        ],
        "symbol_sources": [[sympy.srepr(s), p, d] for s, (p, d) in exported.symbol_sources.items()],
        "output_symbol_sources": [
            [sympy.srepr(s), i, d] for s, (i, d) in exported.output_symbol_sources.items()
        ],
        "carried_sizes": exported.carried_sizes,
        "number_inputs": [[p, str(d).removeprefix("torch.")] for p, d in exported.number_inputs.items()],
    }
    text = json.dumps(description).encode()
    return len(text).to_bytes(8, "big") + text + exported.model.SerializeToString()


def exported_graph_from_bytes(data: bytes) -> ExportedGraph:
    length = int.from_bytes(data[:8], "big")
    description: dict[str, Any] = json.loads(data[8 : 8 + length])
    model = onnx.ModelProto()
    model.ParseFromString(data[8 + length :])
    outputs = [OutputSource(**{k: _decode(v) for k, v in o.items()}) for o in description["outputs"]]
    sources = {sympy.sympify(s): (p, d) for s, p, d in description["symbol_sources"]}
    from_outputs = {sympy.sympify(s): (i, d) for s, i, d in description["output_symbol_sources"]}
    carried = list(description["carried_sizes"])
    numbers = {p: getattr(torch, d) for p, d in description["number_inputs"]}
    return ExportedGraph(
        model, list(description["input_positions"]), outputs, sources, from_outputs, carried, numbers
    )
