"""Which executors run a graph whose tensors live on a given device, in priority order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort
import torch

from ortrain.passes.pipeline import Pass
from ortrain.runtime.executors.base import Executor
from ortrain.runtime.executors.ort import OnnxRuntimeExecutor, provider_for
from ortrain.runtime.executors.python_op import PythonOpExecutor
from ortrain.runtime.executors.torch import TorchExecutor
from ortrain.runtime.placement import DEFAULT, Placement


@dataclass
class Selection:
    executors: list[Executor]
    # Set when ONNX Runtime cannot run on the device: why, and what to install.
    no_onnxruntime: str | None = None


def select_executors(
    device: torch.device,
    *,
    opset_version: int,
    passes: list[tuple[str, Pass]],
    graph_name: str,
    available_providers: list[str] | None = None,
    cache_dir: Path | None = None,
    placement: Placement = DEFAULT,
    declined: frozenset[object] = frozenset(),
) -> Selection:
    """Python op > ONNX Runtime (with the device's execution provider, if installed) > torch.

    ``placement`` (a tuned choice) leaves operator groups, or everything, to torch; ``declined``
    leaves these operators to torch under every placement (the memory optimizer's)."""
    if placement.all_torch:
        return Selection([PythonOpExecutor(), TorchExecutor()])
    available = ort.get_available_providers() if available_providers is None else available_providers
    provider = provider_for(device, available)
    if provider is None:
        advice = (
            "install onnxruntime-gpu (pip install onnxruntime-gpu) in place of onnxruntime"
            if device.type == "cuda"
            else "ONNX Runtime has no execution provider ortrain can bind for it"
        )
        reason = (
            f"the installed onnxruntime has no execution provider for {device.type} tensors "
            f"(available: {', '.join(available)}); {advice}"
        )
        return Selection([PythonOpExecutor(), TorchExecutor()], reason)
    onnxruntime = OnnxRuntimeExecutor(
        device=device,
        provider=provider,
        opset_version=opset_version,
        passes=passes,
        graph_name=graph_name,
        cache_dir=cache_dir,
        declined=placement.declined | declined,
    )
    return Selection([PythonOpExecutor(), onnxruntime, TorchExecutor()])
