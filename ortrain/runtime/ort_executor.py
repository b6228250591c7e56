"""Run an exported graph with an ONNX Runtime ``InferenceSession``, exchanging tensors by pointer.

Inputs (parameters read fresh each call, so in-place optimizer updates are seen) are bound by
``data_ptr()``; outputs are allocated by ONNX Runtime and handed to PyTorch through DLPack, so
saved activations stay in ONNX Runtime's memory until the backward graph has used them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort
import sympy
import torch

from ortrain.export.fx_to_onnx import ExportedGraph

logger = logging.getLogger("ortrain.runtime")

_NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    # ORT's spin-waiting fights PyTorch's threads for the cores: measured 3-4x slower steps.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # The memory-pattern planner allocates beside the arena; without it peak memory drops.
    options.enable_mem_pattern = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.log_severity_level = 3
    return options


class OrtExecutor:
    """A callable ``list of arguments -> list of outputs`` as AOTAutograd expects."""

    def __init__(self, exported: ExportedGraph, *, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the ONNX Runtime executor runs on the CPU, not {device}")
        self.exported = exported
        self._sizes = [
            self._size_formula(s.shape if s.kind == "view" else (s.expr,))
            if s.kind in ("view", "size")
            else None
            for s in exported.outputs
        ]
        self._needs_sizes = any(
            s.kind == "size" or any(e.free_symbols for e in s.shape) for s in exported.outputs
        )
        self.session: ort.InferenceSession | None = None
        if exported.model.graph.node or exported.model.graph.output:
            self.session = ort.InferenceSession(
                exported.model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
            )
            self._input_names = [i.name for i in self.session.get_inputs()]
            self._output_names = [o.name for o in self.session.get_outputs()]
            # The session may prune inputs it does not need; bind only those it kept.
            positions = dict(
                zip((i.name for i in exported.model.graph.input), exported.input_positions, strict=True)
            )
            self._bound = [(name, positions[name]) for name in self._input_names]

    def _run_session(self, args: list[Any]) -> list[torch.Tensor]:
        assert self.session is not None
        binding = self.session.io_binding()
        keep_alive = []
        for name, position in self._bound:
            tensor = args[position]
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
                keep_alive.append(tensor)
            dtype = _NUMPY_DTYPES.get(tensor.dtype)
            if dtype is None:
                raise TypeError(f"ONNX Runtime executor has no binding for dtype {tensor.dtype}")
            binding.bind_input(name, "cpu", 0, dtype, tuple(tensor.shape), tensor.data_ptr())
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        return [torch.from_dlpack(value._ortvalue) for value in binding.get_outputs()]

    def _size_formula(self, exprs: tuple[sympy.Expr, ...]) -> Callable[[list[int]], list[int]]:
        """Sizes as a function of the symbol values; constant sizes cost nothing per call."""
        if not any(e.free_symbols for e in exprs):
            constant = [int(e) for e in exprs]
            return lambda _values: constant
        formula = sympy.lambdify(list(self.exported.symbol_sources), list(exprs), modules="math")
        return lambda values: [int(v) for v in formula(*values)]

    def _symbol_values(self, args: list[Any]) -> list[int]:
        return [args[p].shape[d] for p, d in self.exported.symbol_sources.values()]

    def __call__(self, args: list[Any]) -> list[Any]:
        produced = self._run_session(args) if self.session is not None else []
        results: list[Any] = []
        values = self._symbol_values(args) if self._needs_sizes else []
        for source, sizes in zip(self.exported.outputs, self._sizes, strict=True):
            if source.kind == "onnx":
                results.append(produced[source.index])
            elif source.kind == "input":
                results.append(args[source.index])
            elif source.kind == "same":
                results.append(results[source.index])
            elif source.kind == "none":
                results.append(None)
            elif source.kind == "output_size":
                results.append(produced[source.index].shape[source.dim])
            elif source.kind == "view":
                base = args[source.index] if source.from_input else produced[source.index]
                # reshape, not view: a graph input may be non-contiguous (then this copies).
                results.append(base.reshape(sizes(values)))  # type: ignore[misc]
            else:
                results.append(sizes(values)[0])  # type: ignore[misc]
        return results
