"""Turn one captured FX graph into the callable that runs it: export, passes, executor."""

from __future__ import annotations

import torch

from ortrain.export.fx_to_onnx import ExportError, export_graph
from ortrain.ortmodule.fallback import ORTModuleONNXModelException
from ortrain.passes.pipeline import Pass, StageSaver, run_passes
from ortrain.runtime.ort_executor import OrtExecutor


def build_graph_executor(
    graph: torch.fx.GraphModule,
    *,
    name: str,
    opset_version: int,
    passes: list[tuple[str, Pass]],
    saver: StageSaver | None,
    device: torch.device,
) -> OrtExecutor:
    """Export ``graph`` (the ``name`` graph: "forward" or "backward") and load it into ONNX Runtime."""
    try:
        exported = export_graph(graph, opset_version=opset_version)
    except ExportError as error:
        raise ORTModuleONNXModelException(
            f"the {name} graph could not be exported to ONNX: {error}"
        ) from error
    exported.model = run_passes(exported.model, passes, graph=name, saver=saver)
    try:
        return OrtExecutor(exported, device=device)
    except Exception as error:
        raise ORTModuleONNXModelException(
            f"ONNX Runtime could not load the {name} graph: {type(error).__name__}: {error}"
        ) from error
