"""The ONNX Runtime executor: exports a region of FX nodes to ONNX and runs it in one session.

It claims a node when torch.onnx has an ONNX translation for it; while building a region it checks
every exported ONNX node against ONNX Runtime's kernel registry for the session's execution
provider and the node's element types (bfloat16 ``Gemm`` has no CPU kernel, say), and rejects
the FX nodes that produced the ones without a kernel, so that the partitioner gives them to the
next executor. A session that still refuses a node when it is created is handled the same way.

Tensors cross by pointer: inputs (parameters read fresh each call, so in-place optimizer updates
are seen) are bound by ``data_ptr()`` with IOBinding, for every dtype including bfloat16 (bound
by ONNX element type, as numpy has none); outputs are allocated by ONNX Runtime and handed to
PyTorch through DLPack, so saved activations stay in ONNX Runtime's memory until the backward
graph has used them.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import sympy
import torch

from ortrain.cache.cached_export import export_graph_cached
from ortrain.cache.translation_table import translation_table
from ortrain.capture.number_inputs import as_tensors
from ortrain.capture.size_carriers import carried
from ortrain.capture.symbolic_sizes import size_function
from ortrain.export.element_types import ONNX_ELEMENT_TYPES
from ortrain.export.flash_attention_math import math_form_applies
from ortrain.export.fx_to_onnx import ExportedGraph, ExportError, OutputSource
from ortrain.export.onnx_translations import fx_origins
from ortrain.passes.pipeline import Pass, run_passes
from ortrain.runtime import ort_profile
from ortrain.runtime.executors.base import RegionRejected
from ortrain.runtime.ort_kernel_limits import kernel_refusal
from ortrain.runtime.random_seed import has_random_ops, seed_onnxruntime_from_torch
from ortrain.runtime.startup_timings import timed
from ortrain.runtime.torch_native_ops import is_torch_native

logger = logging.getLogger("ortrain.runtime")

# Marks a reason found in a region's translation that no single operator of it could be blamed
# for (the refusal message groups such reasons: ortrain/runtime/graph_executor.py).
UNTRACED = " (in its translation)"


# The ONNX Runtime execution provider that runs a graph whose tensors live on this device type.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def provider_for(device: torch.device, available: list[str]) -> str | None:
    """The execution provider for ``device`` if the installed onnxruntime has it, else None."""
    provider = PROVIDERS.get(device.type)
    return provider if provider in available else None


def session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    # ORT's spin-waiting fights PyTorch's threads for the cores: measured 3-4x slower steps.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # One knob for both libraries: torch.set_num_threads(n) (or OMP_NUM_THREADS) sizes ONNX
    # Runtime's pools too, so a user who gives PyTorch fewer cores is not overrun by ONNX Runtime.
    options.intra_op_num_threads = torch.get_num_threads()
    # The memory-pattern planner allocates beside the arena; without it peak memory drops.
    options.enable_mem_pattern = False
    # No arena: memory ONNX Runtime frees goes back to malloc, where PyTorch's regions and op
    # tuning's PyTorch candidates reuse it. Tiny GPT, peak RSS with automatic tuning: 1135 MiB
    # with the arena, 917 without; untuned 826 vs 866; step time within run-to-run noise.
    options.enable_cpu_mem_arena = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    # The graph's own order (ortrain's passes keep each fused node where it was exported), not ONNX
    # Runtime's default depth-first order, which ran every weight-gradient product at the end of the
    # backward run and kept each layer's output gradient alive until then. Tiny GPT, batch 4, seq
    # 512: the backward run grows the process by ~255 MiB instead of ~325-345 (with the pass in
    # passes/transposed_matmul.py; either alone did not help).
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # Fatal only: a failed run raises, and ortrain answers with PyTorch's own error where the
    # input is the user's (an index out of range, refused offsets); ONNX Runtime's red line on
    # stderr before it named ortrain's out-of-range marker (wave 51's review).
    options.log_severity_level = 4
    ort_profile.configure(options)  # the benchmarks' per-operator breakdown, when asked for
    return options


# ONNX Runtime's constant folding turns each ``ConstantOfShape`` of a static shape into an
# initializer that the session holds for as long as it lives, and the run then copies: the loss
# backward's (batch x seq) x vocab zeros, the attention's batch x heads x seq x seq zeros, an
# embedding gradient's zeros (tiny GPT, seq 512, batch 2: 51.6 MiB of initializers in the backward
# session, 31.25 MiB of them one zeros tensor; the backward run's peak fell by 37-40 MiB without
# it, the forward's by 27). Computed at run time such a tensor costs one memset and exists only
# while it is used. ortrain's parameters are graph inputs, so there is little else to fold.
#
# GatherSliceToSplitFusion turns Slices of one tensor into one Split, which writes every slice at
# once: the fused loss's per-chunk slices of returned logits (passes/linear_cross_entropy.py)
# became a second rows x vocabulary copy alive for the whole loop. Tiny GPT, batch 36, seq 512,
# memory level 1: the last forward region's peak fell from +1374 to +938 MiB; the region ran 2848 ms
# before and 3066 after (one run each, within this machine's noise).
#
# ExpandElimination removes an ``Expand`` it believes changes no shape, and broadcasting a 1 to a 0
# is one it gets wrong: the backward of an empty slice (``h[:, :0].sum(1)``, or ``h[:, :T // 3]``
# for a T under 3) expands a gradient to ``[2, 0, 4]``, the optimizer dropped that, and the run
# failed ("Reshape ... Input shape:{2,1,4}, requested shape:{0,4}"; onnxruntime 1.32, wave 41). The
# graphs ortrain exports hold no ``Expand`` it would rightly remove (none in the tiny T5's, Llama's
# or BLOOM's forward and backward, counted by their static shapes).
#
# MatMulScaleFusion folds a scale next to a MatMul into the MatMul's alpha, which forms the product
# before the scale: the backward of a mean, ``Expand -> Div(N) -> MatMul``, then summed N times
# larger values first and overflowed at an N-times lower magnitude than eager's (wave 47's review:
# a GradScaler on a batch of 1024 x 4 outputs skipped steps from a loss scale 4096 times below
# eager's first skip, and the parameters drifted 2e-3 apart in 14 steps).
DISABLED_OPTIMIZERS = [
    "ConstantFolding",
    "GatherSliceToSplitFusion",
    "ExpandElimination",
    "MatMulScaleFusion",
]


def _formulas(source: OutputSource) -> tuple[sympy.Expr, ...]:
    """The size formulas of an output: a view's shape, a size, a strided view's sizes, strides
    and storage offset."""
    if source.kind == "size":
        return (source.expr,)
    if source.kind == "strided":
        return (*source.shape, *source.strides, source.offset)
    return source.shape


def _release_model_bytes(session: ort.InferenceSession) -> None:
    """Drop the serialized model the Python session keeps to re-create itself on another provider
    after a failure (onnxruntime's own comment: "holding the memory indefinitely"; the tiny T5's
    seven sessions kept 10.4 MiB of copies). ortrain does not use that fallback: a failing run
    raises, and ortrain's fallback policy answers it, so it is turned off first."""
    session.disable_fallback()
    if getattr(session, "_model_bytes", None) is not None:
        session._model_bytes = None


_TORCH_DTYPES = {t: d for d, t in ONNX_ELEMENT_TYPES.items()}


class OrtSessionRunner:
    """A callable ``list of arguments -> list of outputs`` over one ONNX Runtime session."""

    def __init__(
        self, exported: ExportedGraph, *, device: torch.device, provider: str = "CPUExecutionProvider"
    ) -> None:
        self.exported = exported
        self.device = device
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = device.index or 0
        self._sizes = [
            self._size_formula(_formulas(s)) if s.kind in ("view", "size", "strided") else None
            for s in exported.outputs
        ]
        self._needs_sizes = any(
            s.kind == "size" or any(e.free_symbols for e in _formulas(s)) for s in exported.outputs
        )
        self.session: ort.InferenceSession | None = None
        self._random = False
        if exported.model.graph.node or exported.model.graph.output:
            options: dict[str, str] = {}
            if provider == "CUDAExecutionProvider":
                # Run on PyTorch's current stream, so no synchronisation is needed in between.
                stream = torch.cuda.current_stream(device).cuda_stream
                options = {"device_id": str(self._device_id), "user_compute_stream": str(stream)}
            self.session = ort.InferenceSession(
                exported.model.SerializeToString(),
                session_options(),
                providers=[(provider, options)],
                disabled_optimizers=DISABLED_OPTIMIZERS,
            )
            _release_model_bytes(self.session)
            ort_profile.track(self.session)
            self._input_names = [i.name for i in self.session.get_inputs()]
            self._output_names = [o.name for o in self.session.get_outputs()]
            # The session may prune inputs it does not need; bind only those it kept.
            positions = dict(
                zip((i.name for i in exported.model.graph.input), exported.input_positions, strict=True)
            )
            self._bound = [(name, positions[name]) for name in self._input_names]
            # The floating dtype each input was traced with. A PyTorch kernel can return another
            # than its fake kernel says (batch norm on bfloat16 buffers returns their new values
            # in bfloat16 where the trace has float32), and the session refused such an input
            # ("Unexpected input data type"), which sent the model to PyTorch (wave 43). The cast
            # is made here, for ONNX Runtime only: PyTorch's kernels want the real dtypes (layer
            # norm's float32 statistics of a bfloat16 input, wave 44).
            # So is an empty input's, whatever its dtype: PyTorch's dropout of an empty batch returns
            # its mask in the input's dtype, not bool (wave 48's review: the backward refused it).
            traced = {i.name: i.type.tensor_type.elem_type for i in exported.model.graph.input}
            self._traced_dtypes = {name: _TORCH_DTYPES.get(traced.get(name)) for name in self._input_names}
            self._random = has_random_ops(exported.model)

    def _run_session(self, args: list[Any]) -> list[torch.Tensor]:
        assert self.session is not None
        binding = self.session.io_binding()
        keep_alive = []
        for name, position in self._bound:
            tensor = args[position]
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
                keep_alive.append(tensor)
            traced = self._traced_dtypes[name]
            if (
                traced is not None
                and tensor.dtype != traced
                and ((tensor.dtype.is_floating_point and traced.is_floating_point) or tensor.numel() == 0)
            ):
                tensor = tensor.to(traced)
                keep_alive.append(tensor)
            element_type = ONNX_ELEMENT_TYPES.get(tensor.dtype)
            if element_type is None:
                raise TypeError(f"ONNX Runtime executor has no binding for dtype {tensor.dtype}")
            binding.bind_input(
                name, self._device_type, self._device_id, element_type, tuple(tensor.shape), tensor.data_ptr()
            )
        for name in self._output_names:
            binding.bind_output(name, self._device_type, self._device_id)
        if self._random:
            seed_onnxruntime_from_torch()
        self.session.run_with_iobinding(binding)
        return [torch.from_dlpack(value._ortvalue) for value in binding.get_outputs()]

    def _size_formula(self, exprs: tuple[sympy.Expr, ...]) -> Callable[[list[int]], list[int]]:
        """Sizes as a function of the symbol values; constant sizes cost nothing per call."""
        if not any(e.free_symbols for e in exprs):
            constant = [int(e) for e in exprs]
            return lambda _values: constant
        symbols = [*self.exported.symbol_sources, *self.exported.output_symbol_sources]
        formula = size_function(symbols, exprs)
        return lambda values: formula(*values)

    def _symbol_values(self, args: list[Any], produced: list[torch.Tensor]) -> list[int]:
        return [args[p].shape[d] for p, d in self.exported.symbol_sources.values()] + [
            produced[i].shape[d] for i, d in self.exported.output_symbol_sources.values()
        ]

    def __call__(self, args: list[Any]) -> list[Any]:
        if self.exported.carried_sizes:
            args = carried(args, self.exported.carried_sizes)
        if self.exported.number_inputs:
            args = as_tensors(args, self.exported.number_inputs)
        produced = self._run_session(args) if self.session is not None else []
        results: list[Any] = []
        values = self._symbol_values(args, produced) if self._needs_sizes else []
        later: list[int] = []  # views of other outputs, and second names, once those are known
        for source, sizes in zip(self.exported.outputs, self._sizes, strict=True):
            if source.kind == "onnx":
                results.append(produced[source.index])
            elif source.kind == "input":
                results.append(args[source.index])
            elif source.kind in ("same", "strided"):
                later.append(len(results))
                results.append(None)
            elif source.kind == "none":
                results.append(None)
            elif source.kind == "output_size":
                results.append(produced[source.index].shape[source.dim])
            elif source.kind == "number":
                results.append(produced[source.index].item())
            elif source.kind == "view":
                base = args[source.index] if source.from_input else produced[source.index]
                # reshape, not view: a graph input may be non-contiguous (then this copies).
                results.append(base.reshape(sizes(values)))  # type: ignore[misc]
            else:
                results.append(sizes(values)[0])  # type: ignore[misc]
        for position in sorted(later, key=lambda p: self.exported.outputs[p].kind == "same"):
            source = self.exported.outputs[position]
            if source.kind == "same":
                results[position] = results[source.index]
            else:  # "strided": a view of a contiguous output, with the trace's strides and offset
                rank = len(source.shape)
                geometry = self._sizes[position](values)  # type: ignore[misc]
                base = results[source.index]
                results[position] = base.as_strided(geometry[:rank], geometry[rank : 2 * rank], geometry[-1])
        return results


# ---- which ONNX nodes the execution provider has kernels for ----------------------------------


@functools.cache
def _kernel_registry() -> tuple[dict[tuple[str, str, str], list[Any]], dict[tuple[str, str], list[Any]]]:
    """ONNX Runtime's registered kernels by (domain, op, provider), and its op schemas by (domain, op)."""
    from onnxruntime.capi import _pybind_state as ort_c  # the only public listing of kernels

    kernels: dict[tuple[str, str, str], list[Any]] = {}
    for kernel in ort_c.get_all_opkernel_def():
        kernels.setdefault((_domain(kernel.domain), kernel.op_name, kernel.provider), []).append(kernel)
    schemas: dict[tuple[str, str], list[Any]] = {}
    for schema in ort_c.get_all_operator_schema():
        schemas.setdefault((_domain(schema.domain), schema.name), []).append(schema)
    return kernels, schemas


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def _type_string(element_type: int) -> str:
    return f"tensor({onnx.TensorProto.DataType.Name(element_type).lower()})"


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types: dict[str, int] = {}
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    for initializer in graph.initializer:
        types[initializer.name] = initializer.data_type
    for node in graph.node:
        if (
            node.op_type == "Constant"
            and node.attribute
            and node.attribute[0].type == onnx.AttributeProto.TENSOR
        ):
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def _formal_types(params: Any, count: int) -> list[str]:
    """The type string of each of ``count`` actual inputs or outputs (a variadic last one repeats)."""
    found = [p.typeStr for p in params][:count]
    if params and len(found) < count:
        found += [params[-1].typeStr] * (count - len(found))
    return found


def missing_kernels(model: onnx.ModelProto, provider: str) -> list[tuple[onnx.NodeProto, str]]:
    """The nodes of ``model`` that ``provider`` has no kernel for at their element types, and why."""
    kernels, schemas = _kernel_registry()
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    local_functions = {(f.domain, f.name) for f in model.functions}
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as error:  # types then come from the exporter's value_info alone
        logger.debug("shape inference failed before the kernel check: %s", error)
    types = _element_types(model)
    missing: list[tuple[onnx.NodeProto, str]] = []
    for node in model.graph.node:
        domain = _domain(node.domain)
        # Constants become initializers when the session loads; local functions are inlined.
        if node.op_type == "Constant" or (node.domain, node.op_type) in local_functions:
            continue
        version = opsets.get(domain, 1)
        candidates = [
            k
            for k in kernels.get((domain, node.op_type, provider), [])
            if k.version_range[0] <= version <= k.version_range[1]
        ]
        if not candidates:
            if _is_function_op(domain, node.op_type, version):
                continue  # ONNX Runtime inlines its function body (HardSwish, Mish, Bernoulli)
            missing.append((node, f"{provider} has no {node.op_type}-{version} kernel"))
            continue
        known = [s for s in schemas.get((domain, node.op_type), []) if s.since_version <= version]
        if not known:
            continue
        schema = max(known, key=lambda s: s.since_version)
        actual: list[tuple[str, str]] = []  # (type parameter, actual type)
        for formal, value in (
            *zip(_formal_types(schema.inputs, len(node.input)), node.input, strict=True),
            *zip(_formal_types(schema.outputs, len(node.output)), node.output, strict=True),
        ):
            if value and value in types:
                actual.append((formal, _type_string(types[value])))

        def fits(kernel: Any, actual: list[tuple[str, str]] = actual) -> bool:
            constraints = kernel.type_constraints
            return all(t in constraints[p] for p, t in actual if p in constraints)

        if not any(fits(k) for k in candidates):
            seen = sorted({t.removeprefix("tensor(").removesuffix(")") for _, t in actual})
            missing.append((node, f"{provider} has no {node.op_type} kernel for {'/'.join(seen)}"))
            continue
        refused = _refused_reduction(node, types, provider)
        if refused is not None:
            missing.append((node, refused))
    return missing


# Registered for these types, but the CPU kernels refuse a reduction on them when they run
# ("BFloat16 data type is not supported with ScatterND opset 16 when reduction is 'add'"): a
# bfloat16 embedding backward failed at its first run, after the session had loaded.
_CPU_SCATTERS = frozenset({"ScatterND", "ScatterElements"})
_NO_CPU_REDUCTION = frozenset({onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16})


def _refused_reduction(node: onnx.NodeProto, types: dict[str, int], provider: str) -> str | None:
    if provider != "CPUExecutionProvider" or node.op_type not in _CPU_SCATTERS or node.domain:
        return None
    reduction = next((a.s.decode() for a in node.attribute if a.name == "reduction"), "none")
    data_type = types.get(node.input[0])
    if reduction == "none" or data_type not in _NO_CPU_REDUCTION:
        return None
    name = onnx.TensorProto.DataType.Name(data_type).lower()
    return f"{provider} has no {node.op_type} reduction={reduction} kernel for {name}"


def _is_function_op(domain: str, op_type: str, version: int) -> bool:
    try:
        schema = onnx.defs.get_schema(op_type, version, domain)
    except Exception:  # not an ONNX-standard op
        return False
    return bool(schema.has_function or schema.has_context_dependent_function)


def _signature(node: torch.fx.Node) -> tuple[Any, ...]:
    """An operator, the dtypes it sees and its flags: what decides whether a kernel exists. The
    flags choose among ONNX operators: ``convolution`` is a ``Conv`` or, ``transposed``, a
    ``ConvTranspose`` (wave 50's review: a double ``ConvTranspose`` refused was taken for the
    ``Conv`` beside it, both named after it, both sent to PyTorch)."""
    values = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    dtypes = tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in values)
    flags = tuple(a for a in (*node.args, *node.kwargs.values()) if isinstance(a, bool))
    return (node.target, dtypes, flags)


_MISSING_TYPES = re.compile(r" kernel for (\S+)$")


def _sees_types_of(node: torch.fx.Node, why: str) -> bool:
    """Whether ``node``'s dtypes include every element type a "no kernel for X/Y" reason names."""
    named = _MISSING_TYPES.search(why)
    if named is None:
        return True  # no kernel at all for the op: not a matter of dtypes
    seen = {
        onnx.TensorProto.DataType.Name(ONNX_ELEMENT_TYPES[d]).lower()
        for d in _signature(node)[1]
        if d in ONNX_ELEMENT_TYPES
    }
    return set(named.group(1).split("/")) <= seen


_NAMED_TYPES = re.compile(r" kernel for (?P<types>[a-z0-9/]+)")
_LOW_PRECISION = {"bfloat16", "float16"}


def missing_low_precision_kernel(why: str) -> bool:
    """Whether a refusal is only that the provider has no kernel for a 16-bit float type (the CPU
    provider's matrix products and most arithmetic under bf16/fp16 autocast; a ``Where`` names
    its boolean condition beside the 16-bit values)."""
    named = _NAMED_TYPES.search(why)
    types = set(named.group("types").split("/")) if named else set()
    return bool(types & _LOW_PRECISION) and types <= _LOW_PRECISION | {"bool"}


# (provider, operator, dtypes) -> why ONNX Runtime cannot run it: learned once per process, so
# later regions and graphs do not export a node only to reject it again.
_learned_refusals: dict[tuple[Any, ...], str] = {}

_REJECTED_NODE = re.compile(r"node with name '([^']*)'")
_FAILED_TRANSLATION = re.compile(r"Error when translating node %(\S+) :")


class OnnxRuntimeExecutor:
    """Claims nodes that have an ONNX translation and a kernel in ``provider``, except the
    operators a placement declines and those PyTorch runs by design (:mod:`ortrain.runtime.
    torch_native_ops`): those are not refusals, nothing warns about them."""

    name = "onnxruntime"
    merges = True

    def __init__(
        self,
        *,
        device: torch.device,
        provider: str,
        opset_version: int,
        passes: list[tuple[str, Pass]],
        graph_name: str,
        cache_dir: Path | None = None,
        declined: frozenset[object] = frozenset(),
    ) -> None:
        self.device = device
        # Operators it could run but leaves to the next executor (a tuned placement).
        self.declined = declined
        self.cache_dir = cache_dir  # ORTMODULE_CACHE_DIR
        self.provider = provider
        self.opset_version = opset_version
        self.passes = passes
        self.graph_name = graph_name
        self.rejected: dict[str, str] = {}  # FX node name -> why ONNX Runtime cannot run it
        self._built: dict[str, OrtSessionRunner] = {}
        self._regions_built = 0  # names regions in logs and timings: "backward[2]"
        # Which operators torch.onnx translates: from ORTMODULE_CACHE_DIR when it knows (a warm
        # cache then never builds torch.onnx's op registry), else looked up and stored there.
        self._translations = translation_table(cache_dir)

    def refusal(self, node: torch.fx.Node) -> str | None:
        if is_torch_native(node):
            return None  # left to PyTorch on purpose, not refused
        if node.name in self.rejected:
            return self.rejected[node.name]
        learned = _learned_refusals.get((self.provider, *_signature(node)))
        if learned is not None:
            return learned
        if math_form_applies(node):
            return None  # exported as its math form (ortrain.export.flash_attention_math)
        if not self._translations.has_onnx_translation(node.target):
            return "no ONNX translation"
        return kernel_refusal(node)

    def claims(self, node: torch.fx.Node) -> bool:
        return (
            node.op == "call_function"
            and node.target not in self.declined
            and not is_torch_native(node)
            and self.refusal(node) is None
        )

    def build(self, region: torch.fx.GraphModule, *, what: str, whole: bool) -> OrtSessionRunner:
        # A region that a re-partition left as it was is not exported again.
        key = str(region.graph)
        if key not in self._built:
            try:
                self._built[key] = self._build(region)
            finally:
                self._translations.save()  # what the partition and this build looked up
        return self._built[key]

    def forget_builds(self) -> None:
        """Drop the sessions kept for re-partitions (those in use live on in their runners)."""
        self._built.clear()

    def _build(self, region: torch.fx.GraphModule) -> OrtSessionRunner:
        nodes = [n.name for n in region.graph.nodes if n.op == "call_function"]
        label = f"{self.graph_name}[{self._regions_built}]" if self._regions_built else self.graph_name
        self._regions_built += 1
        try:
            exported = export_graph_cached(
                region, opset_version=self.opset_version, cache_dir=self.cache_dir, name=label
            )
        except ExportError as error:
            if error.operator is not None:
                calls = [n for n in region.graph.nodes if n.op == "call_function"]
                # The missing operator itself, or else the ops whose decomposition produced it.
                culprits = [n for n in calls if str(n.target) == error.operator] or [
                    n for n in calls if self._translations.decomposed_at_export(n.target)
                ]
                why = (
                    "no ONNX translation"
                    if culprits and str(culprits[0].target) == error.operator
                    else (f"its decomposition needs {error.operator}, which has no ONNX translation")
                )
                if culprits:
                    raise RegionRejected({n.name: why for n in culprits}) from error
            # The translator names the node it failed on: that node alone goes to PyTorch (IBert's
            # `1.0 // x` sent its whole region, 65 nodes, there).
            failed = _FAILED_TRANSLATION.search(str(error))
            if failed is not None and failed.group(1) in nodes:
                first_line = str(error).splitlines()[0][:300]
                raise RegionRejected({failed.group(1): f"its translation failed: {first_line}"}) from error
            raise RegionRejected({name: f"export of its region failed: {error}" for name in nodes}) from error
        before = exported.model
        with timed("passes", label):
            exported.model = run_passes(exported.model, self.passes, graph=self.graph_name, saver=None)
        reasons = {**self._wrong_dtypes(region, exported), **self._missing_kernels(region, exported.model)}
        by_name = {n.name: n for n in region.graph.nodes}
        for name, why in reasons.items():
            # Learned for the whole process only when blamed by name (not guessed) and when the
            # node sees the types the kernel lacks: an ONNX node mapped back to the wrong FX node
            # (a float32 Where blamed for a bfloat16 one) must not refuse that op everywhere.
            node = by_name.get(name)
            if node is not None and not why.endswith(UNTRACED) and _sees_types_of(node, why):
                _learned_refusals[(self.provider, *_signature(node))] = why
        if reasons:
            raise RegionRejected(reasons)
        try:
            with timed("session", label):
                runner = OrtSessionRunner(exported, device=self.device, provider=self.provider)
        except Exception as error:
            text = f"{type(error).__name__}: {error}"
            named = _REJECTED_NODE.search(str(error))
            origin = fx_origins(exported.model, region.graph).get(named.group(1)) if named else None
            if origin is not None:
                raise RegionRejected({origin: f"ONNX Runtime refused it ({text})"}) from error
            raise RegionRejected(
                {name: f"ONNX Runtime could not load its region ({text})" for name in nodes}
            ) from error
        runner.model_before_passes = before  # type: ignore[attr-defined]
        return runner

    def _missing_kernels(self, region: torch.fx.GraphModule, model: onnx.ModelProto) -> dict[str, str]:
        calls = [n for n in region.graph.nodes if n.op == "call_function"]
        names = {n.name for n in calls}
        # Ops the exporter decomposes yield ONNX nodes named after the decomposition's nodes.
        decomposed = [n.name for n in calls if self._translations.decomposed_at_export(n.target)]
        reasons: dict[str, str] = {}
        origins = fx_origins(model, region.graph)
        for onnx_node, why in missing_kernels(model, self.provider):
            origin = origins.get(onnx_node.name)
            if origin in names:
                reasons.setdefault(origin, why)  # type: ignore[arg-type]
                continue
            # Not traceable to one FX node: blame the decomposed ops, else the whole region.
            for name in decomposed or sorted(names):
                reasons.setdefault(name, f"{why}{UNTRACED}")
        return reasons

    @staticmethod
    def _wrong_dtypes(region: torch.fx.GraphModule, exported: ExportedGraph) -> dict[str, str]:
        """Region outputs whose ONNX element type is not PyTorch's dtype (the exporter's bfloat16
        ``native_layer_norm`` returns float32 statistics, say): PyTorch would be handed the wrong
        dtype. Inside a region such a difference is ONNX's own business."""
        returned = list(region.graph.output_node().args[0])  # type: ignore[arg-type]
        onnx_outputs = exported.model.graph.output
        reasons: dict[str, str] = {}
        for node, source in zip(returned, exported.outputs, strict=True):
            from_onnx = source.kind == "onnx" or (source.kind == "view" and not source.from_input)
            if not from_onnx or not isinstance(node, torch.fx.Node):
                continue
            value = node.meta.get("val")
            got = onnx_outputs[source.index].type.tensor_type.elem_type
            if isinstance(value, torch.Tensor) and ONNX_ELEMENT_TYPES.get(value.dtype, got) != got:
                culprit = node.args[0] if node.target is operator.getitem else node
                reasons[culprit.name] = (  # type: ignore[union-attr]
                    f"its ONNX translation returns {onnx.TensorProto.DataType.Name(got).lower()} "
                    f"where PyTorch returns {value.dtype}"
                )
        return reasons
