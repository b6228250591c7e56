"""Turn one captured FX graph into the callable that runs it: export, passes, executor.

A graph without python ops becomes one ONNX model in one :class:`OrtExecutor`. A graph with python
ops (opaque ``torch.autograd.Function`` calls) is split by :mod:`ortrain.runtime.partitioner` into
ONNX segments, each exported and run by its own executor, and python-op steps run in PyTorch; all
tensors cross by pointer. The debug files then show one ONNX "view" of the whole graph in which
each python op is a ``PythonOp``/``PythonOpGrad`` node named by its Function.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import onnx
import torch
from torch.fx.node import map_aggregate

from ortrain.cache.cached_export import export_graph_cached
from ortrain.capture.python_ops import lookup_call
from ortrain.export.fx_to_onnx import ExportedGraph, ExportError
from ortrain.export.python_op_view import PythonOpNode, ViewSegment, python_op_view
from ortrain.ortmodule.fallback import ORTModuleONNXModelException
from ortrain.ortmodule.options import openmp_wait_policy
from ortrain.passes.pipeline import Pass, StageSaver, run_passes
from ortrain.runtime.ort_executor import OrtExecutor
from ortrain.runtime.partitioner import OnnxSegment, Plan, PythonOpStep, Slot, contains_python_ops, partition
from ortrain.runtime.python_op import run_backward, run_forward
from ortrain.runtime.startup_timings import timed

logger = logging.getLogger("ortrain.runtime")


def build_graph_executor(
    graph: torch.fx.GraphModule,
    *,
    name: str,
    opset_version: int,
    passes: list[tuple[str, Pass]],
    saver: StageSaver | None,
    device: torch.device,
    cache_dir: Path | None = None,
) -> OrtExecutor | SegmentedExecutor:
    """Export ``graph`` (the ``name`` graph: "forward" or "backward") and load it into ONNX Runtime.

    With ``cache_dir`` (ORTMODULE_CACHE_DIR) each export is looked up there first.
    """
    if not contains_python_ops(graph):
        exported = _export(
            graph, what=f"the {name} graph", opset_version=opset_version, name=name, cache_dir=cache_dir
        )
        with timed("passes", name):
            exported.model = run_passes(exported.model, passes, graph=name, saver=saver)
        return _load(exported, what=f"the {name} graph", device=device, name=name)
    plan = partition(graph)
    _advise_passive_openmp()
    runners: list[OrtExecutor | None] = []
    before: list[ViewSegment | PythonOpNode] = []
    after: list[ViewSegment | PythonOpNode] = []
    for position, step in enumerate(plan.steps):
        if isinstance(step, PythonOpStep):
            runners.append(None)
            call = lookup_call(step.call_id)
            node = PythonOpNode(step.name, call.func_name, step.is_grad, step.input_slots, step.outputs)
            before.append(node)
            after.append(node)
            continue
        what = f"segment {position} of the {name} graph"
        exported = _export(
            step.graph,
            what=what,
            opset_version=opset_version,
            name=f"{name}[{position}]",
            cache_dir=cache_dir,
        )
        before.append(ViewSegment(exported.model, exported, step.inputs, step.outputs))
        with timed("passes", f"{name}[{position}]"):
            exported.model = run_passes(exported.model, passes, graph=name, saver=None)
        after.append(ViewSegment(exported.model, exported, step.inputs, step.outputs))
        runners.append(_load(exported, what=what, device=device, name=f"{name}[{position}]"))
    logger.info(
        "%s graph: %d ONNX segments around %d python ops",
        name,
        sum(r is not None for r in runners),
        sum(r is None for r in runners),
    )
    if saver is not None:
        returned: list[int] = []
        map_aggregate(plan.outputs, lambda a: returned.append(a.index) if isinstance(a, Slot) else None)
        for stage, steps in (("exported", before), ("optimized", after)):
            view = python_op_view(
                steps,
                input_names=[p.name for p in plan.placeholders],
                outputs=returned,
                values=plan.values,
                opset_version=opset_version,
            )
            saver.save(view, name, stage)
    return SegmentedExecutor(plan, runners)


@functools.cache
def _advise_passive_openmp() -> None:
    if openmp_wait_policy() != "PASSIVE":
        # Measured on the tiny GPT with a custom GELU: 1.12x the built-in GELU's step time
        # with the default policy, 0.98x with PASSIVE.
        logger.warning(
            "this model runs PyTorch Functions between ONNX Runtime segments; start Python with "
            "OMP_WAIT_POLICY=PASSIVE so that PyTorch's spinning OpenMP threads do not slow ONNX "
            "Runtime's kernels down"
        )


def _export(
    graph: torch.fx.GraphModule, *, what: str, opset_version: int, name: str, cache_dir: Path | None
) -> ExportedGraph:
    try:
        return export_graph_cached(graph, opset_version=opset_version, cache_dir=cache_dir, name=name)
    except ExportError as error:
        raise ORTModuleONNXModelException(f"{what} could not be exported to ONNX: {error}") from error


def _load(exported: ExportedGraph, *, what: str, device: torch.device, name: str) -> OrtExecutor:
    try:
        with timed("session", name):
            return OrtExecutor(exported, device=device)
    except Exception as error:
        raise ORTModuleONNXModelException(
            f"ONNX Runtime could not load {what}: {type(error).__name__}: {error}"
        ) from error


class SegmentedExecutor:
    """Runs a partitioned graph: ONNX segments in ONNX Runtime, python ops in PyTorch."""

    def __init__(self, plan: Plan, runners: list[OrtExecutor | None]) -> None:
        self.plan = plan
        self.runners = runners
        # The executor holds its Functions' records itself, so they outlive the capture's registry
        # entries for as long as a pending backward may need them.
        calls = [lookup_call(s.call_id) if isinstance(s, PythonOpStep) else None for s in plan.steps]
        self._schedule = list(zip(plan.steps, runners, calls, plan.frees, strict=True))

    @property
    def onnx_models(self) -> list[onnx.ModelProto]:
        return [r.exported.model for r in self.runners if r is not None]

    def __call__(self, args: list[Any]) -> list[Any]:
        plan = self.plan
        env: list[Any] = [None] * plan.num_slots
        env[: plan.num_inputs] = args

        def read(value: Any) -> Any:
            return env[value.index] if isinstance(value, Slot) else value

        for step, runner, call, frees in self._schedule:
            if isinstance(step, OnnxSegment):
                assert runner is not None
                produced = runner([env[s] for s in step.inputs])
                for slot, value in zip(step.outputs, produced, strict=True):
                    env[slot] = value
            else:
                assert call is not None
                values = map_aggregate(step.args, read)
                if step.is_grad:  # (handle, grad_outputs, call_id, sizes)
                    result = run_backward(call, values[0], list(values[1]))
                else:  # (inputs, call_id)
                    result = run_forward(call, list(values[0]))
                for index, slot in step.outputs.items():
                    env[slot] = result[index]
            for slot in frees:
                env[slot] = None
        return list(map_aggregate(plan.outputs, read))
