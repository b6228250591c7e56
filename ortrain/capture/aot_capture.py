"""Capture a module's forward and backward as ATen FX graphs with AOTAutograd.

This package is the only place that touches torch-private APIs, so a torch upgrade changes one
folder. AOTAutograd also provides the runtime glue: the compiled callable is a
``torch.autograd.Function`` that saves activations between the graphs, applies buffer mutations,
sums gradients of tied parameters and regenerates aliased outputs. ortrain plugs its executors in
as that callable's forward and backward "compilers".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._functorch.aot_autograd as aot_autograd
from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput, PlainAOTInput
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ortrain.capture.capture_package import GraphCode, recording_entries
from ortrain.capture.causal_mask_detection import causal_masks_read_as_given
from ortrain.capture.checkpointing import CheckpointRegions
from ortrain.capture.cumulative_batch_norm import cumulative_batch_norm_traceable
from ortrain.capture.data_assignments import data_assignments_as_copies
from ortrain.capture.decompositions import decomposition_table
from ortrain.capture.detached_outputs import detached_outputs
from ortrain.capture.encoder_padding_fast_path import encoder_padding_as_eager
from ortrain.capture.environment_reads import environment_reads_recorded
from ortrain.capture.fake_mode_release import forget_real_tensors, graph_fake_modes
from ortrain.capture.forward_rewrite import ForwardRewrite, ForwardTrace, rewrite_forward
from ortrain.capture.function_calls import intercept_functions
from ortrain.capture.function_overrides import function_overrides
from ortrain.capture.input_metadata_changes import refuse_metadata_changes
from ortrain.capture.memory_optimizer import MemoryOptimizerConfig, MemoryReport
from ortrain.capture.module_paths import annotate_module_paths
from ortrain.capture.output_layouts import traced_layouts
from ortrain.capture.outside_writes import outside_writes_undone
from ortrain.capture.partition import partition
from ortrain.capture.print_calls import print_calls_noted
from ortrain.capture.profiler_ranges import profiler_ranges_left_out
from ortrain.capture.python_ops import (
    call_of,
    iter_python_op_nodes,
    python_op,
    python_op_grad,
    release_calls,
)
from ortrain.capture.recurrent_layers import RecurrentLayer
from ortrain.capture.running_statistics import batch_norm_statistics, versions_kept
from ortrain.capture.saved_output_copies import SavedOutputs
from ortrain.capture.shape_env_caches import release_shape_env_caches
from ortrain.capture.shared_submodules import shared_submodules_restored
from ortrain.capture.size_guards import SizeGuards
from ortrain.capture.stale_gradients import stale_gradients_set_aside
from ortrain.capture.subclass_views import subclasses_as_plain_tensors
from ortrain.capture.tensor_attributes import tensor_attributes_as_buffers
from ortrain.capture.tracing_context import tracing_context
from ortrain.capture.unused_tangents import leave_unused_tangents_none

logger = logging.getLogger("ortrain.capture")

GraphRunner = Callable[[list[Any]], list[Any]]


@dataclass
class GraphSlot:
    """One graph that AOTAutograd hands over, and the executor that runs it.

    Until an executor is installed the FX graph runs in PyTorch, which is also the reference the
    other executors are checked against.
    """

    graph: torch.fx.GraphModule
    runner: GraphRunner | None = None

    def run(self, args: list[Any]) -> list[Any]:
        if self.runner is None:
            return self.graph(*args)
        return self.runner(args)


def _fixed_size(size: int | torch.SymInt) -> int | None:
    if isinstance(size, int):
        return size
    # The shape environment replaces a symbol that a guard pinned to a number by that number.
    shape_env = size.node.shape_env
    expr = shape_env.replace(size.node.expr) if shape_env is not None else size.node.expr
    return int(expr) if expr.is_number else None


@dataclass
class Capture:
    """The result of one capture: a callable over ``(*params_and_buffers, *inputs)`` and its graphs."""

    fn: Callable[..., Any]
    state_names: list[str]
    forward: GraphSlot
    backward: GraphSlot | None
    training: bool
    dynamic_dims: dict[int, tuple[int, ...]] = field(default_factory=dict)
    memory_report: MemoryReport | None = None  # training captures: what the memory optimizer did
    # The pre-dispatch forward graph the rewrites ran on (None where not traced).
    forward_trace: ForwardTrace | None = None
    # AOTAutograd's cache entry for this capture (``package=True``; None where the graphs call
    # Python objects of this process): see ortrain.capture.capture_package.
    package_entry: Any = None
    # What tracing assumed about symbolic sizes: the graphs hold only for inputs that pass.
    size_guards: SizeGuards = field(default_factory=lambda: SizeGuards(None))
    # The inputs the forward writes into (``x.add_(1)``), by position among the call's inputs.
    mutated_inputs: frozenset[int] = frozenset()
    # Of those, the ones written only inside a ``no_grad`` block of the forward.
    writes_hidden_from_autograd: frozenset[int] = frozenset()
    # Positions among ``(*state, *inputs)`` of the tensors only batch norms' running statistics
    # updates write: their version counters stay, as eager's kernel leaves them
    # (capture/running_statistics.py).
    running_statistics: frozenset[int] = frozenset()
    # Parameters and buffers without elements that the forward writes into: it sizes them on first
    # use (a per-channel quantization observer's min/max), which its fake trace cannot show.
    sized_on_first_use: tuple[str, ...] = ()
    # Modules the forward called that the model does not hold (capture/module_paths.py), weakly:
    # the wrapper watches them for hooks of the user's added later.
    unheld_modules: tuple[weakref.ref[torch.nn.Module], ...] = ()
    # The environment variables the model's code read while traced, with the values it got (None:
    # unset): the graphs hold only while they have these values (capture/environment_reads.py).
    environment: tuple[tuple[str, str | None], ...] = ()

    def input_placeholders(self, inputs: Sequence[torch.Tensor], aliased: bool) -> list[torch.fx.Node] | None:
        """The forward graph's placeholder of each of the call's inputs, in order; None where the
        graph has no one-to-one placeholder per input: AOTAutograd merges inputs that alias each
        other and are written to into one synthetic base (``m(n, x, x)`` with ``x.add_(1)``)."""
        placeholders = self.forward.graph.graph.find_nodes(op="placeholder")
        if (aliased and self.mutated_inputs) or len(placeholders) < len(self.state_names) + len(inputs):
            return None
        # The inputs come last: state comes before them, and so do AOTAutograd's effect tokens
        # (a graph with linalg.inv's error check has one).
        nodes = placeholders[len(placeholders) - len(inputs) :]
        values = [node.meta.get("val") for node in nodes]
        if not all(
            isinstance(v, torch.Tensor) and v.dim() == t.dim() for v, t in zip(values, inputs, strict=True)
        ):
            return None
        return nodes

    def input_sizes(self, inputs: Sequence[torch.Tensor], aliased: bool) -> list[tuple[int | None, ...]]:
        """Per input, the sizes the graphs hold for: a number where the graphs fixed the size, None
        where they compute with whatever size comes. A size traced as symbolic can end up fixed
        all the same: an unrolled LSTM loops over the sequence, which specializes the length to
        the one traced (a guard ``s1 == 24`` whose graph reshapes to 8 × 24). Where the graph has
        no placeholder per input, every size is taken as fixed: a new one captures again."""
        placeholders = self.input_placeholders(inputs, aliased)
        if placeholders is None:
            return [tuple(t.shape) for t in inputs]
        return [tuple(_fixed_size(s) for s in node.meta["val"].shape) for node in placeholders]

    def calls_python_beyond_recurrent_layers(self) -> bool:
        """Whether a graph calls Python objects other than the recurrent layers ortrain runs as
        opaque Functions (:mod:`ortrain.capture.recurrent_layers`), whose PyTorch modules a
        recompute under ``create_graph=True`` differentiates twice as eager does (wave 47's
        review: a gradient penalty through an ``nn.LSTM`` was refused)."""
        slots = [self.forward, *([self.backward] if self.backward else [])]
        for slot in slots:
            for node in iter_python_op_nodes(slot.graph.graph):
                if not issubclass(call_of(node).cls, RecurrentLayer):
                    return True
        return False

    def refuse_writes_into_leaves(self, inputs: Sequence[torch.Tensor]) -> None:
        """Eager PyTorch refuses an in-place op on a leaf that requires grad; the graph, which
        writes its inputs back after running, would not (it changed the tensor and gave it a
        gradient). Raises PyTorch's error, before anything runs."""
        written = self.mutated_inputs - self.writes_hidden_from_autograd
        if not written or not torch.is_grad_enabled():
            return
        for position in written:
            tensor = inputs[position]
            if tensor.requires_grad and tensor.is_leaf:
                raise RuntimeError(
                    "a leaf Variable that requires grad is being used in an in-place operation."
                )
            base = tensor._base
            if tensor.requires_grad and base is not None and base.is_leaf and base.requires_grad:
                # (wave 49's review: the graph ran and failed, and the default policy sent the
                # model to PyTorch for good over the user's mistake)
                raise RuntimeError(
                    "a view of a leaf Variable that requires grad is being used in an in-place operation."
                )

    def statistics_versions_kept(
        self, state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
    ) -> contextlib.AbstractContextManager[None]:
        """A block around a call of this capture (or anything that runs it) after which the
        running statistics it writes read their version counters as before, as after eager."""
        if not self.running_statistics:
            return contextlib.nullcontext()
        tensors = [*state, *inputs]
        return versions_kept([tensors[i] for i in sorted(self.running_statistics)])

    def __call__(self, state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Any:
        outputs = self.fn(*state, *inputs)
        if self.backward is not None:  # no zeros gradient for an unused output (unused_tangents.py)
            function = leave_unused_tangents_none(outputs)
            if function is not None:
                donates_no_saved_tensor(getattr(function, "metadata", None))
        return outputs


def donates_no_saved_tensor(metadata: Any) -> None:
    """Let ``backward(retain_graph=True)`` run the backward graph as often as asked.

    AOTAutograd lists the saved tensors that only the backward reads as "donated" (in the forward's
    ``metadata``), so that a backward compiler may write into their memory, and then refuses a
    retained graph ("This backward function was compiled with non-empty donated buffers"). No
    ortrain executor writes into a graph input (the torch executor scatters in place only into
    zeros its own graph made; the plan runner only drops references), so none is donated.
    """
    if metadata is not None and getattr(metadata, "bw_donated_idxs", None):
        metadata.bw_donated_idxs = []


def _fake_inputs(
    inputs: Sequence[torch.Tensor], dynamic_dims: dict[int, tuple[int, ...]]
) -> list[torch.Tensor]:
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = []
    for i, tensor in enumerate(inputs):
        dims = dynamic_dims.get(i, ())
        # DYNAMIC rather than DUCK: two sizes that happen to be equal in this batch (batch 8 and
        # 8 heads, say) must not become one symbol.
        context = StatelessSymbolicContext(
            dynamic_sizes=[
                DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(tensor.dim())
            ]
        )
        fakes.append(fake_mode.from_tensor(tensor, symbolic_context=context))
    return fakes


def _distinct_state_names(module: torch.nn.Module, names: list[str]) -> list[str]:
    """``names`` (the parameters' then the buffers', each name of a tensor) with each tensor's first
    name only: the order of AOTAutograd's deduplicated inputs. Until wave 42 the metadata was read
    against every name, and a BatchNorm registered under two names failed the capture ("zip()
    argument 2 is shorter than argument 1")."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    seen: set[int] = set()
    distinct = []
    for name in names:
        tensor = named.get(name)
        if tensor is not None:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
        distinct.append(name)
    return distinct


def _positions(descs: Sequence[Any], state_names: list[str], n_inputs: int) -> frozenset[int]:
    """The positions among ``(*state, *inputs)`` of the graph inputs ``descs`` names: a parameter or
    buffer by its (first) name, an input by its index. Another kind of input (a synthetic base of
    inputs that alias each other) has no one position: left out, its counter moves."""
    positions = set()
    for desc in descs:
        if isinstance(desc, ParamAOTInput | BufferAOTInput) and desc.target in state_names:
            positions.add(state_names.index(desc.target))
        elif isinstance(desc, PlainAOTInput) and 0 <= desc.idx < n_inputs:
            positions.add(len(state_names) + desc.idx)
    return frozenset(positions)


def _skip_unread_graph_logs(joint: Any) -> None:
    """AOTAutograd renders the joint, forward and backward graphs as text for its loggers whether
    or not anyone reads them (0.1-0.2 s per capture of the tiny GPT); render them only when
    ``TORCH_LOGS`` or ``TORCH_TRACE`` asks for them."""
    from torch._logging._internal import log_state, trace_log

    if trace_log.handlers or any(
        log_state.is_artifact_enabled(name) for name in ("aot_graphs", "aot_joint_graph")
    ):
        return
    state = joint._aot_state
    state.aot_config = dataclasses.replace(state.aot_config, enable_log=False)


def _calls_python(slots: dict[str, GraphSlot]) -> bool:
    """A graph with python ops names records of this process (ortrain.capture.python_ops)."""
    python = {python_op, python_op_grad}
    return any(node.target in python for slot in slots.values() for node in slot.graph.graph.nodes)


def capture(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    training: bool,
    dynamic_dims: dict[int, tuple[int, ...]] | None = None,
    opaque_functions: bool = True,
    checkpoint_ops: bool = False,
    skipped_functions: frozenset[str] = frozenset(),
    memory: MemoryOptimizerConfig | None = None,
    forward_rewrites: Sequence[ForwardRewrite] = (),
    trace_forward_graph: bool = False,
    package: bool = False,
) -> Capture:
    """Trace ``module(*inputs)`` (a module over flat tensors returning a tuple of tensors).

    ``training`` asks for a forward graph that saves what the backward graph needs; otherwise one
    forward-only graph that saves nothing. ``dynamic_dims`` maps an input position to the sizes
    that may change between calls. ``opaque_functions`` (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD) makes
    each user ``torch.autograd.Function`` call one python op; otherwise Functions are traced
    through like any other code. ``checkpoint_ops`` (ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT) makes
    reentrant activation checkpoints python ops too; otherwise they are traced and recomputed in
    the backward graph. ``skipped_functions`` (ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS) names Functions,
    by module path and ``__qualname__``, that are traced through even when Functions are opaque.
    ``memory`` chooses the recompute plans of the memory optimizer.
    ``forward_rewrites`` edit the forward before it is differentiated (see
    :mod:`ortrain.capture.forward_rewrite`); ``trace_forward_graph`` keeps that pre-dispatch graph
    on the result even without rewrites (the inspector reads it). ``package`` records what a later
    process needs to run the capture without tracing (:mod:`ortrain.capture.capture_package`).
    """
    slots: dict[str, GraphSlot] = {}

    def compiler(tag: str) -> Callable[[torch.fx.GraphModule, Any], Any]:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            slot = GraphSlot(gm)
            slots[tag] = slot
            # The forward's outputs in the layout eager gives them (see capture/output_layouts.py).
            metadata = joint._aot_state.fw_metadata
            if tag != "forward":
                return GraphCode(slot)
            layouts = traced_layouts(gm.graph, metadata)
            return GraphCode(
                slot,
                output_layouts=layouts,
                forward=True,
                detached=detached_outputs(metadata),
                saved_outputs=SavedOutputs(metadata) if metadata is not None else None,
            )

        return compile_graph

    dynamic_dims = {i: tuple(d) for i, d in (dynamic_dims or {}).items() if d}
    example = _fake_inputs(inputs, dynamic_dims) if dynamic_dims else list(inputs)
    grad_mode = torch.enable_grad() if training else torch.no_grad()
    with contextlib.ExitStack() as stack:
        stack.enter_context(outside_writes_undone())  # put back last: after the traces' own undoing
        environment = stack.enter_context(environment_reads_recorded())
        stack.enter_context(print_calls_noted())
        stack.enter_context(grad_mode)
        stack.enter_context(tracing_context())
        # torch.compile'd code in the model (``torch.compile(model)`` or ``submodule.compile()``
        # before wrapping) is traced as the Python it compiles: a compiled frame run under the
        # trace failed ("Attempting to use FunctionalTensor on its own") and sent the model to
        # the fallback.
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(stale_gradients_set_aside(module.parameters()))
        stack.enter_context(tensor_attributes_as_buffers(module))
        stack.enter_context(data_assignments_as_copies(module))
        stack.enter_context(subclasses_as_plain_tensors())  # see capture/subclass_views.py
        unheld_modules = stack.enter_context(annotate_module_paths(module))
        stack.enter_context(shared_submodules_restored())
        stack.enter_context(causal_masks_read_as_given())
        # ctc_loss, recurrent layers: see capture/function_overrides.py
        stack.enter_context(function_overrides(recurrent_as_python_ops=opaque_functions))
        stack.enter_context(cumulative_batch_norm_traceable())
        stack.enter_context(profiler_ranges_left_out())
        stack.enter_context(encoder_padding_as_eager())
        regions = CheckpointRegions(as_python_ops=checkpoint_ops and opaque_functions)
        stack.enter_context(regions.patched())
        call_ids = stack.enter_context(
            intercept_functions(
                opaque=opaque_functions, hook=regions.function_hook, skipped=skipped_functions
            )
        )
        traced_module, trace = module, None
        if forward_rewrites or trace_forward_graph:
            # Layer names cost capture time and only the memory summary reads them: logged at
            # INFO, and wanted when memory is being tuned (a level or a config).
            summary_read = memory is not None and (
                memory.level > 0 or bool(memory.requests) or logger.isEnabledFor(logging.INFO)
            )
            traced_module, trace = rewrite_forward(
                module, example, forward_rewrites, module_paths=summary_read, values=inputs
            )
            if traced_module is not module and not inputs:
                # The rewritten graph needs fake inputs that carry a shape environment (below); a
                # model without inputs has none to carry it, so it is captured as written.
                traced_module = module
            elif traced_module is not module and not dynamic_dims:
                # A gather of the rows a data-dependent mask selects has a size known only at run
                # time (an unbacked size): tracing it needs fake inputs with a shape environment.
                example = _fake_inputs(inputs, {})
        # The backward traced outside autocast, as PyTorch recommends calling backward (and as the
        # Trainer and accelerate do): with the forward's autocast (AOTAutograd's default), the
        # gradient of a float32 matmul in an `autocast(enabled=False)` region came out bfloat16
        # where eager's is float32 (wave 44). A backward under autocast is warned about at run time.
        stack.enter_context(torch._functorch.config.patch(backward_pass_autocast="off"))
        joint = aot_autograd.aot_export_joint_with_descriptors(
            stack, traced_module, tuple(example), decompositions=decomposition_table()
        )
        _skip_unread_graph_logs(joint)
        input_info = joint._aot_state.fw_metadata.input_info
        distinct = _distinct_state_names(traced_module, [*joint.params_spec, *joint.buffers_spec])
        names = distinct + [f"input {i}" for i in range(len(input_info) - len(distinct))]
        refuse_metadata_changes(input_info, names)
        reports: list[MemoryReport] = []
        entries: list[Any] = []
        if package:
            stack.enter_context(recording_entries(joint, entries))
        fn = aot_autograd.aot_compile_joint_with_descriptors(
            joint,
            partition_fn=functools.partial(partition, memory=memory, reports=reports),
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
        )
    state_names = list(joint.params_spec) + list(joint.buffers_spec)
    # AOTAutograd's metadata holds each distinct tensor once (a module under two names: its
    # parameters and buffers twice in the names, once there).
    user_inputs = joint._aot_state.fw_metadata.input_info[len(distinct) :]
    mutated = frozenset(i for i, info in enumerate(user_inputs) if info.mutates_data)
    # Written where autograd sees it: not under no_grad inside the forward (an adversarial
    # perturbation clamped in place, which eager allows on a leaf that requires grad).
    hidden_writes = frozenset(
        i
        for i in mutated
        if user_inputs[i].mutations_hidden_from_autograd
        or user_inputs[i].mutations_under_no_grad_or_inference_mode
    )
    state_args = joint._aot_state.flat_args[: len(distinct)]
    state_info = joint._aot_state.fw_metadata.input_info[: len(distinct)]
    sized_on_first_use = tuple(
        name
        for name, arg, info in zip(distinct, state_args, state_info, strict=True)
        if info.mutates_data and isinstance(arg, torch.Tensor) and arg.numel() == 0
    )
    if "forward" not in slots:
        raise RuntimeError("AOTAutograd produced no forward graph")
    running_statistics = _positions(
        batch_norm_statistics(slots["forward"].graph.graph), state_names, len(inputs)
    )
    if training and "backward" not in slots:
        logger.debug("no output requires grad: the training capture has no backward graph")
    # Not stored where the forward read the environment or called modules the model does not hold:
    # the key on disk covers neither, and a loaded capture would not know to watch them.
    storable = (
        entries and not call_ids and not _calls_python(slots) and not environment and not unheld_modules
    )
    captured = Capture(
        fn=fn,
        state_names=state_names,
        forward=slots["forward"],
        backward=slots.get("backward"),
        training=training,
        dynamic_dims=dynamic_dims,
        memory_report=reports[0] if reports else None,
        forward_trace=trace,
        package_entry=entries[0] if storable else None,
        size_guards=SizeGuards.of(example) if dynamic_dims else SizeGuards(None),
        mutated_inputs=mutated,
        writes_hidden_from_autograd=hidden_writes,
        sized_on_first_use=sized_on_first_use,
        running_statistics=running_statistics,
        unheld_modules=tuple(weakref.ref(m) for m in unheld_modules.values()),
        environment=tuple(environment.items()),
    )
    # The python ops' records live as long as the graphs that name them.
    weakref.finalize(captured, release_calls, call_ids)
    # The graphs keep their fake modes alive, and those weak references to the model's tensors.
    backward = captured.backward.graph if captured.backward is not None else None
    graphs = (captured.forward.graph, backward, trace.graph_module if trace is not None else None)
    forget_real_tensors([joint._aot_state.fake_mode, *graph_fake_modes(graphs)])
    release_shape_env_caches()
    return captured
