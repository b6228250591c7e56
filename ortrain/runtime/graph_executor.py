"""Turn one captured FX graph into the callable that runs it: partition, build, run.

The executors chosen for the graph's device (:mod:`ortrain.runtime.selection`) claim its nodes
and the partitioner (:mod:`ortrain.runtime.partitioner`) makes regions of them; each region gets
a runner from its executor. When the ONNX Runtime executor finds, while building a region, nodes
its execution provider cannot run (no kernel for that dtype, no ONNX translation after all), the
graph is partitioned again without them. Nodes that ONNX Runtime cannot run then run in PyTorch,
with one warning per graph naming them and why; under a fallback policy without
``FALLBACK_UNSUPPORTED_ONNX_MODEL`` (``FALLBACK_DISABLE``) that is an error naming them.
Operators without an ONNX equivalent (:mod:`ortrain.runtime.torch_native_ops`: factorizations,
complex tensors) run in PyTorch under every policy: one INFO line per graph names them.

A graph that ONNX Runtime runs whole is one session over the original graph (the fast path). For
other graphs the debug files show one ONNX "view" of the whole graph: ONNX regions joined by
``PythonOp``/``PythonOpGrad`` nodes (opaque Functions) and ``TorchRegion`` nodes (PyTorch).
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections import Counter
from pathlib import Path
from typing import Any

import sympy
import torch
from torch.fx.node import map_aggregate

from ortrain.capture.compile_lock import COMPILE_LOCK
from ortrain.capture.unused_tangents import (
    carried_outputs,
    has_size_symbols,
    is_tangent,
    size_symbols,
    without_inputs,
    zeros_like_value,
)
from ortrain.errors import FallbackPolicy, ORTModuleDeviceException, ORTModuleONNXModelException
from ortrain.export.python_op_view import PythonOpNode, TorchRegionNode, ViewSegment, python_op_view
from ortrain.passes.pipeline import Pass, StageSaver
from ortrain.runtime.executors.base import RegionRejected, Runner, fx_target_name, fx_target_name_of
from ortrain.runtime.executors.ort import (
    UNTRACED,
    OnnxRuntimeExecutor,
    OrtSessionRunner,
    missing_low_precision_kernel,
)
from ortrain.runtime.executors.python_op import PythonOpExecutor
from ortrain.runtime.executors.torch import TorchExecutor
from ortrain.runtime.partitioner import Plan, Slot, Step, partition
from ortrain.runtime.placement import DEFAULT, Placement
from ortrain.runtime.selection import select_executors
from ortrain.runtime.startup_timings import timed
from ortrain.runtime.torch_native_ops import torch_native_reason

logger = logging.getLogger("ortrain.runtime")

# Each retry follows a rejection that names at least one new node, so this only bounds surprises.
_MAX_PARTITIONS = 16


def build_graph_executor(
    graph: torch.fx.GraphModule,
    *,
    name: str,
    opset_version: int,
    passes: list[tuple[str, Pass]],
    saver: StageSaver | None,
    device: torch.device,
    policy: FallbackPolicy | None = None,
    available_providers: list[str] | None = None,
    openmp_passive: bool = True,
    cache_dir: Path | None = None,
    placement: Placement = DEFAULT,
    declined: frozenset[object] = frozenset(),
    announce: bool = True,
    segments: int = 1,
) -> PlanRunner:
    """Build the runner of ``graph`` (the ``name`` graph: "forward" or "backward").

    ``openmp_passive``: PyTorch's OpenMP threads do not spin (``OMP_WAIT_POLICY=PASSIVE``); when
    they do and the graph mixes PyTorch work with ONNX Runtime regions, a warning advises it.
    ``cache_dir`` (ORTMODULE_CACHE_DIR): each region's export is looked up there first.
    ``placement``: operator groups left to PyTorch (see :mod:`ortrain.runtime.placement`);
    ``declined``: operators left to PyTorch under any placement.
    ``announce``: log the plan and its advice; the tuner builds candidates quietly and speaks
    for the one it keeps. ``segments``: a graph ONNX Runtime runs whole is cut into up to that many
    consecutive sessions, so that its inputs are freed as the run goes (ORTMODULE_BACKWARD_SEGMENTS).
    """
    policy = FallbackPolicy.default() if policy is None else policy
    selection = select_executors(
        device,
        opset_version=opset_version,
        passes=passes,
        graph_name=name,
        available_providers=available_providers,
        cache_dir=cache_dir,
        placement=placement,
        declined=declined,
    )
    if selection.no_onnxruntime is not None:
        if not policy & FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE:
            raise ORTModuleDeviceException(selection.no_onnxruntime)
        _warn_once_per_device(str(device.type), selection.no_onnxruntime)
    executors = selection.executors
    onnxruntime = next((e for e in executors if isinstance(e, OnnxRuntimeExecutor)), None)
    allow_torch = bool(policy & FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL)
    for _ in range(_MAX_PARTITIONS):
        with timed("partition", name):  # the first look-up builds torch.onnx's op registry (1.1 s)
            plan = partition(graph, executors, segments=segments)
        if onnxruntime is not None and not allow_torch:
            refused = _refused(plan, onnxruntime)
            if refused:
                raise ORTModuleONNXModelException(_refusal_message(name, refused, disabled=True))
        # Build every region, collecting what each rejects, so one re-partition answers them all.
        runners: list[Runner] = []
        rejected: dict[str, str] = {}
        for step in plan.steps:
            try:
                runners.append(
                    step.executor.build(
                        step.region, what=f"region {step.name} of the {name} graph", whole=plan.whole
                    )
                )
            except RegionRejected as rejection:
                rejected.update(rejection.reasons)
        if not rejected:
            break
        assert onnxruntime is not None
        new = {k: v for k, v in rejected.items() if k not in onnxruntime.rejected}
        if not new:
            raise ORTModuleONNXModelException(f"ONNX Runtime cannot run the {name} graph: {rejected}")
        onnxruntime.rejected.update(new)
        if not allow_torch:
            targets = {n.name: fx_target_name(n) for n in graph.graph.nodes}
            refused = {n: (targets.get(n, n), why) for n, why in new.items()}
            raise ORTModuleONNXModelException(_refusal_message(name, refused, disabled=True))
    else:
        raise ORTModuleONNXModelException(
            f"the {name} graph could not be partitioned in {_MAX_PARTITIONS} tries"
        )
    if onnxruntime is not None:
        onnxruntime.forget_builds()
        refused = _refused(plan, onnxruntime)
        if refused and announce:
            # A 16-bit float the provider has no kernels for is the user's choice of precision
            # (autocast), and PyTorch's kernels are the ones eager would run: nothing to fix.
            chosen_precision = all(missing_low_precision_kernel(why) for _, why in refused.values())
            level = logging.INFO if chosen_precision else logging.WARNING
            logger.log(level, _refusal_message(name, refused, disabled=False))
    if announce:
        announce_plan(plan, name, openmp_passive=openmp_passive)
        _announce_declined(plan, name, declined)
    if saver is not None:
        _save_views(plan, runners, saver, name, opset_version)
    return PlanRunner(plan, runners)


def announce_plan(plan: Plan, name: str, *, openmp_passive: bool) -> None:
    """The plan at INFO, and the OpenMP advice when PyTorch work sits between ONNX Runtime regions."""
    # A step that only checks values (a CTC loss's input lengths) runs no OpenMP work to spin.
    executors = {type(s.executor) for s in plan.steps if not _only_runtime_checks(s)}
    if OnnxRuntimeExecutor in executors and len(executors) > 1 and not openmp_passive:
        _advise_passive_openmp()
    logger.info(
        "%s graph: %s",
        name,
        ", ".join(f"{count} nodes in {e}" for e, count in plan.nodes_by_executor().items()),
    )
    native = _torch_native(plan)
    if native:
        logger.info(
            "%s graph: PyTorch runs %d node(s) by design (see torch_native_ops.py): %s",
            name,
            sum(native.values()),
            "; ".join(f"{op} x{count} ({why})" for (op, why), count in sorted(native.items())),
        )


def _only_runtime_checks(step: Step) -> bool:
    nodes = [n for n in step.nodes if n.op == "call_function" and n.target is not operator.getitem]
    return (
        isinstance(step.executor, TorchExecutor)
        and bool(nodes)
        and all(torch_native_reason(n) == "runtime check" for n in nodes)
    )


def _announce_declined(plan: Plan, name: str, declined: frozenset[object]) -> None:
    counts: dict[str, int] = {}
    for step in plan.steps:
        if isinstance(step.executor, TorchExecutor):
            for node in step.nodes:
                if node.target in declined:
                    op = fx_target_name(node)
                    counts[op] = counts.get(op, 0) + 1
    if counts:
        logger.info(
            "%s graph: PyTorch runs %s (memory optimizer: one pass and one output where ONNX "
            "Runtime's translation keeps several temporaries alive)",
            name,
            ", ".join(f"{op} x{count}" for op, count in sorted(counts.items())),
        )


def _torch_native(plan: Plan) -> dict[tuple[str, str], int]:
    """(operator, why) -> how many nodes of the plan PyTorch runs by design (torch_native_ops)."""
    found: dict[tuple[str, str], int] = {}
    for step in plan.steps:
        if not isinstance(step.executor, TorchExecutor):
            continue
        for node in step.nodes:
            if node.target is operator.getitem:
                continue
            why = torch_native_reason(node)
            if why is not None:
                op = fx_target_name(node)
                if op == "with_effects" and len(node.args) > 1:
                    op = f"with_effects({fx_target_name_of(node.args[1])})"
                found[(op, why)] = found.get((op, why), 0) + 1
    return found


def _refused(plan: Plan, onnxruntime: OnnxRuntimeExecutor) -> dict[str, tuple[str, str]]:
    """Nodes running in PyTorch that ONNX Runtime refused: name -> (operator, why)."""
    refused: dict[str, tuple[str, str]] = {}
    for step in plan.steps:
        if not isinstance(step.executor, TorchExecutor):
            continue
        for node in step.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            why = onnxruntime.refusal(node)
            if why is not None:
                refused[node.name] = (fx_target_name(node), why)
    return refused


def _refusal_message(name: str, refused: dict[str, tuple[str, str]], *, disabled: bool) -> str:
    by_reason: dict[tuple[str, str], int] = {}
    # A reason no single operator could be blamed for is said once, with the operators of the
    # region it came from: until wave 42 it was repeated for each ("getitem (no Sub kernel for
    # bfloat16 (in its translation)) x25; aten._to_copy.default (no Sub kernel ...) x24; ...").
    untraced: dict[str, Counter[str]] = {}
    # So is a reason several operators share (a region ONNX Runtime could not load names each of
    # its operators with the loader's whole message: wave 48's review saw it 25 times in a line).
    shared: dict[str, Counter[str]] = {}
    for target, why in refused.values():
        if why.endswith(UNTRACED):
            untraced.setdefault(why.removesuffix(UNTRACED), Counter())[target] += 1
        else:
            shared.setdefault(why, Counter())[target] += 1
    for why, targets in shared.items():
        if len(targets) == 1:
            ((target, count),) = targets.items()
            by_reason[(target, why)] = count
    parts = [
        f"{target} ({why}){f' x{count}' if count > 1 else ''}"
        for (target, why), count in sorted(by_reason.items())
    ]
    for why, targets in sorted(shared.items()):
        if len(targets) > 1:
            among = ", ".join(f"{t}{f' x{c}' if c > 1 else ''}" for t, c in targets.most_common())
            parts.append(f"{among} ({why})")
    for why, targets in sorted(untraced.items()):
        among = ", ".join(f"{t}{f' x{c}' if c > 1 else ''}" for t, c in targets.most_common())
        parts.append(f"{why}, in the translation of one of these, not told which: {among}")
    listed = "; ".join(parts)
    if disabled:
        return (
            f"ONNX Runtime cannot run {len(refused)} operator(s) of the {name} graph: {listed}. "
            "ORTMODULE_FALLBACK_POLICY without FALLBACK_UNSUPPORTED_ONNX_MODEL forbids running them in "
            "PyTorch; add it (it is in the default policy) to run just these in PyTorch"
        )
    return (
        f"{name} graph: {len(refused)} operator(s) run in PyTorch because ONNX Runtime cannot run them "
        f"(everything else runs in ONNX Runtime): {listed}"
    )


@functools.cache
def _warn_once_per_device(device: str, reason: str) -> None:
    logger.warning("graphs on %s run in PyTorch, not ONNX Runtime: %s", device, reason)


@functools.cache
def _advise_passive_openmp() -> None:
    # Measured on the tiny GPT with a custom GELU: 1.12x the built-in GELU's step time with the
    # default policy, 0.98x with PASSIVE.
    logger.warning(
        "this model runs PyTorch work between ONNX Runtime regions; start Python with "
        "OMP_WAIT_POLICY=PASSIVE so that PyTorch's spinning OpenMP threads do not slow ONNX "
        "Runtime's kernels down"
    )


def _save_views(plan: Plan, runners: list[Runner], saver: StageSaver, name: str, opset_version: int) -> None:
    if plan.whole and isinstance(runners[0], OrtSessionRunner):
        saver.save(runners[0].model_before_passes, name, "exported")  # type: ignore[attr-defined]
        saver.save(runners[0].exported.model, name, "optimized")
        return
    before: list[Any] = []
    after: list[Any] = []
    for step, runner in zip(plan.steps, runners, strict=True):
        if isinstance(runner, OrtSessionRunner):
            before.append(ViewSegment(runner.model_before_passes, runner.exported, step.inputs, step.outputs))  # type: ignore[attr-defined]
            after.append(ViewSegment(runner.exported.model, runner.exported, step.inputs, step.outputs))
            continue
        if isinstance(step.executor, PythonOpExecutor):
            call = runner.call  # type: ignore[attr-defined]
            node: Any = PythonOpNode(
                step.name,
                call.func_name,
                runner.is_grad,
                step.inputs,
                dict(enumerate(step.outputs)),  # type: ignore[attr-defined]
            )
        else:
            operators = [fx_target_name(n) for n in step.nodes if n.op == "call_function"]
            node = TorchRegionNode(step.name, operators, step.inputs, dict(enumerate(step.outputs)))
        before.append(node)
        after.append(node)
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


class _ZeroOutputs:
    """A variant's runner, its zero outputs (removed from its region) given back as None."""

    def __init__(self, runner: Runner, zero_outputs: frozenset[int], width: int) -> None:
        self.runner = runner
        self.zero_outputs = zero_outputs
        self._kept = [p for p in range(width) if p not in zero_outputs]
        self._width = width

    def __call__(self, args: list[Any]) -> list[Any]:
        results: list[Any] = [None] * self._width
        for position, value in zip(self._kept, self.runner(args), strict=True):
            results[position] = value
        return results


class PlanRunner:
    """Runs a partitioned graph: each region by its executor's runner, values crossing by slot."""

    def __init__(self, plan: Plan, runners: list[Runner]) -> None:
        self.plan = plan
        self.runners = runners
        self._schedule = [
            (runner, step.inputs, step.outputs, frees, step.executor.name)
            for step, runner, frees in zip(plan.steps, runners, plan.frees, strict=True)
        ]
        # Set to a dict to accumulate seconds per executor name (benchmarks/bench_ortmodule.py).
        self.profile: dict[str, float] | None = None
        # Graph inputs that are output gradients (None when the loss does not use the output).
        self._tangents = {i for i, p in enumerate(plan.placeholders) if is_tangent(p)}
        self._symbolic = has_size_symbols(plan.placeholders)
        # Slots a variant left None because they are zeros made of unused gradients.
        self._zero_slots: set[int] = set()
        # (step, positions of its None tangents) -> the step's runner without them (None: zeros fed)
        self._variants: dict[tuple[int, frozenset[int]], Runner | None] = {}
        # Slots that may hold an output gradient: the tangents and what regions compute from them.
        self._gradients = set(self._tangents)
        for step in plan.steps:
            carriers = {p for p, s in enumerate(step.inputs) if s in self._gradients}
            if carriers:
                self._gradients.update(step.outputs[p] for p in carried_outputs(step.region, carriers))

    def __call__(self, args: list[Any]) -> list[Any]:
        plan = self.plan
        env: list[Any] = [None] * plan.num_slots
        env[: plan.num_inputs] = args
        # Zeros for missing gradients take dynamic sizes from this call's inputs.
        symbols = (
            size_symbols(plan.placeholders, args) if self._symbolic and any(a is None for a in args) else {}
        )
        # Boxed calling convention (AOTAutograd's backward hands over its only list of saved
        # tensors): from here the plan owns the inputs and drops each after its last reader.
        args.clear()
        for slot, value in plan.constants.items():
            env[slot] = value
        profile = self.profile
        for index, (runner, inputs, outputs, frees, executor) in enumerate(self._schedule):
            values = [env[s] for s in inputs]
            if (self._tangents or self._zero_slots) and any(v is None for v in values):
                runner, values = self._without_unused_tangents(index, runner, values, symbols)
            if profile is not None:
                start = time.perf_counter()
                produced = runner(values)
                profile[executor] = profile.get(executor, 0.0) + time.perf_counter() - start
            else:
                produced = runner(values)
            del values
            for slot, value in zip(outputs, produced, strict=True):
                env[slot] = value
            if isinstance(runner, _ZeroOutputs):
                self._zero_slots.update(outputs[p] for p in runner.zero_outputs)
            for slot in frees:
                env[slot] = None
        return list(map_aggregate(plan.outputs, lambda v: self._result(env, v, symbols)))

    def _result(self, env: list[Any], value: Any, symbols: dict[sympy.Symbol, int]) -> Any:
        if not isinstance(value, Slot):
            return value
        if env[value.index] is None and value.index in self._zero_slots:
            return zeros_like_value(self.plan.values[value.index], symbols)  # a gradient of the graph
        return env[value.index]

    def _without_unused_tangents(
        self, index: int, runner: Runner, values: list[Any], symbols: dict[sympy.Symbol, int]
    ) -> tuple[Runner, list[Any]]:
        """Step ``index`` where some output gradients are None (see ortrain.capture.unused_tangents):
        it runs as a variant that computes nothing of theirs and makes the zeros it still needs
        inside (built once: a region's export, or the whole graph's); a variant that cannot be
        built gets zeros fed."""
        step = self.plan.steps[index]
        missing = frozenset(
            p
            for p, (s, v) in enumerate(zip(step.inputs, values, strict=True))
            if v is None and (s in self._tangents or s in self._zero_slots)
        )
        if not missing:
            return runner, values
        if getattr(runner, "is_grad", False):
            # An opaque Function's backward takes None for an output gradient, as eager gives it:
            # no zeros to make (whose sizes may be nowhere among this graph's inputs).
            return runner, values
        key = (index, missing)
        if key not in self._variants:
            # Also for a graph run whole: zeros fed through the unused output's backward meet its
            # derivative, and where that is infinite 0 * inf = NaN reached every gradient.
            carriers = {p for p, s in enumerate(step.inputs) if p not in missing and s in self._gradients}
            self._variants[key] = self._build_variant(step, missing, carriers, whole=self.plan.whole)
        variant = self._variants[key]
        if variant is not None:
            return variant, [v for p, v in enumerate(values) if p not in missing]
        return runner, [
            zeros_like_value(self.plan.values[s], symbols) if p in missing else v
            for p, (s, v) in enumerate(zip(step.inputs, values, strict=True))
        ]

    @staticmethod
    def _build_variant(
        step: Step, missing: frozenset[int], carriers: set[int], *, whole: bool
    ) -> Runner | None:
        region = without_inputs(step.region, set(missing), carriers)
        if region is None:
            logger.debug(
                "region %s: zeros fed for its unused gradients (a size only this call knows)", step.name
            )
            return None
        what = f"region {step.name} without unused gradients"
        try:
            # An export, like a capture's: one at a time, and the user's generator untouched.
            with COMPILE_LOCK, torch.random.fork_rng(devices=[]):
                runner = step.executor.build(region, what=what, whole=whole)
        except Exception as error:
            # PyTorch runs the variant rather than zeros being fed: they may meet an infinite
            # derivative, which the variant does not compute.
            logger.debug(
                "region %s: no %s variant without unused gradients (%s)", step.name, step.executor.name, error
            )
            try:
                runner = TorchExecutor().build(region, what=what, whole=whole)
            except Exception as torch_error:
                logger.debug("region %s: zeros fed for its unused gradients (%s)", step.name, torch_error)
                return None
        zero_outputs = region.meta.get("zero_outputs", frozenset())
        return _ZeroOutputs(runner, zero_outputs, len(step.outputs)) if zero_outputs else runner
