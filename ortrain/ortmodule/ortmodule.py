"""``ORTModule``: wrap an ``nn.Module`` so that its forward and backward run on ONNX Runtime."""

from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from ortrain.cache.cached_capture import load_capture, save_capture
from ortrain.cache.capture_key import capture_key
from ortrain.capture.aot_capture import Capture, GraphSlot, capture
from ortrain.capture.attribute_assignments import (
    AssignedAttributes,
    assign_attributes,
    assigned_tensor_paths,
    buffers_before,
    take_attribute_assignments,
    with_assigned_attributes,
)
from ortrain.capture.attribute_reads import AttributeReads
from ortrain.capture.autograd_hooks import AutogradHookError, refusing_autograd_hooks
from ortrain.capture.checkpointing import RECOMPUTATION_STOPS
from ortrain.capture.compile_lock import COMPILE_LOCK
from ortrain.capture.differentiating_hooks import (
    DifferentiatingHookError,
    forward_defines_differentiating_hook,
)
from ortrain.capture.exact_numbers import exact_plain_form
from ortrain.capture.forward_mode_ad import carries_tangents
from ortrain.capture.functorch_transforms import functorch_transform_active
from ortrain.capture.generator_resets import GeneratorResetError, refusing_generator_resets, user_forward
from ortrain.capture.huggingface import register_hf_cache_types
from ortrain.capture.input_metadata_changes import InputMetadataChangeError
from ortrain.capture.lazy_recompile import graph_modules_compiled_on_first_call
from ortrain.capture.memoized_functions import memoized_functions_unwrapped
from ortrain.capture.memory_optimizer import MemoryOptimizerConfig
from ortrain.capture.module_hooks import has_users_hooks
from ortrain.capture.module_paths import UnheldModuleHooksError
from ortrain.capture.parametrization_cache import parametrizations_cached
from ortrain.capture.plain_values import NOT_PLAIN, python_attributes
from ortrain.capture.tracing_context import capturing
from ortrain.errors import GeneratorInputError, exception_chain
from ortrain.inspector.runtime_inspector import RuntimeInspector
from ortrain.ortmodule._custom_autograd_function import custom_autograd_enabled
from ortrain.ortmodule.backward_under_autocast import watch_for_backward_under_autocast
from ortrain.ortmodule.create_graph import (
    CALLS_PYTHON,
    READS_AN_OUTSIDE_TENSOR,
    WRITES_ITS_INPUT,
    watch_for_create_graph,
)
from ortrain.ortmodule.distributed_wrappers import (
    refuse_data_parallel_inside,
    refuse_distributed_submodules,
    refuse_fsdp_wrapper_class,
)
from ortrain.ortmodule.eager_check import run_eagerly_leaving_no_trace
from ortrain.ortmodule.fallback import (
    FallbackManager,
    ORTModuleDeviceException,
    ORTModuleFallbackException,
    ORTModuleIOError,
    ORTModuleONNXModelException,
    ORTModuleTorchModelException,
)
from ortrain.ortmodule.forward_hooks import user_forward_hooks
from ortrain.ortmodule.graph_breaks import (
    GraphBreakPath,
    in_control_flow_operator,
    inside_graph_break_path,
    is_data_dependent,
    on_sparse_tensors,
    reads_outside_tensors,
)
from ortrain.ortmodule.graph_cache import GraphCache
from ortrain.ortmodule.guards import (
    ModelState,
    binding_order,
    describe_change,
    is_deepspeed_hook_state,
    read_state,
    without_config_values,
)
from ortrain.ortmodule.inactive_options import announce_inactive_options
from ortrain.ortmodule.input_containers import InputContainerChange, contents, refuse_changed_containers
from ortrain.ortmodule.log_output import configure_log_output
from ortrain.ortmodule.module_snapshot import ModuleSnapshot
from ortrain.ortmodule.options import (
    DebugOptions,
    RuntimeOptions,
    environment_for_cache_key,
    model_environment,
    openmp_wait_policy,
    python_log_level,
    runtime_options,
    user_malloc_setting,
)
from ortrain.ortmodule.python_randomness import PythonRandomnessError, refusing_python_randomness
from ortrain.ortmodule.scalars import (
    LiftedCall,
    ScalarLifter,
    call_leaves,
    unread_lifted_inputs,
    without_number_values,
)
from ortrain.ortmodule.schema import (
    Spec,
    flatten_inputs,
    flatten_outputs,
    memory_layout,
    tensor_signature,
    unflatten,
)
from ortrain.ortmodule.second_order import BufferWrites, needs_second_order_path, run_twice_differentiable
from ortrain.ortmodule.shared_registries import ModelPostHooks, ModelTable, refuse_root_parametrization
from ortrain.ortmodule.signature import (
    base_wrapper_class,
    new_wrapper,
    wrapped_module_signature,
    wrapper_class_for,
)
from ortrain.ortmodule.zero3 import zero3_gathered, zero3_parameters
from ortrain.passes.pipeline import ForwardRewrite, StageSaver, default_passes, forward_rewrites
from ortrain.runtime.freed_memory_reuse import reuse_freed_memory
from ortrain.runtime.full_collections import compile_garbage_collected
from ortrain.runtime.placement import memory_level_declined
from ortrain.runtime.placement_tuning import TunedRunner, TuningSettings, build_tuned_graph_executor
from ortrain.runtime.startup_timings import timed

logger = logging.getLogger("ortrain.ortmodule")

# Names ORTModule keeps for itself; every other attribute lives on the wrapped module.
_OWN_ATTRIBUTES = frozenset(
    {
        "_ortrain_module",
        "_ortrain_debug",
        "_ortrain_options",
        "_ortrain_memory",
        "_ortrain_graphs",
        "_ortrain_reads",
        "_ortrain_environment",
        "_ortrain_unheld",
        "_ortrain_fallback",
        "_ortrain_scalars",
        "_ortrain_graph_breaks",
        "_ortrain_changed_by_capture",
        "_ortrain_inspector",
        "_ortrain_forward_lock",
        "_ortrain_training",
        "training",
        # FSDP2's fully_shard (and other composable wrappers) give the wrapper a subclass of its
        # own class; passed on, the model had turned into a wrapper without a model.
        "__class__",
    }
)


# How nn.Module calls the wrapper itself, set by code that wraps or hooks the wrapper: an instance
# ``forward`` (accelerate's mixed precision, the HF Trainer's bf16=True, sets ``forward`` and
# ``_original_forward``), ``register_full_backward_hook``'s flag, ``Module.compile()``'s compiled
# call. Passed to the wrapped module, each made that module call the wrapper again (a capture that
# recursed until it crashed) or left the wrapper's own hooks unread (a backward hook never ran).
_CALL_ATTRIBUTES = frozenset(
    {"forward", "_original_forward", "_is_full_backward_hook", "_compiled_call_impl"}
)


class _SizedOnFirstUse(Exception):
    """The capture writes state that has no elements yet: the forward sizes it on first use."""

    def __init__(self, changes: list[str]) -> None:
        super().__init__("; ".join(changes))
        self.changes = changes


class _FlatCall(nn.Module):
    """The wrapped module seen as a function of flat tensors returning a tuple of tensors."""

    def __init__(self, module: nn.Module, input_spec: Spec) -> None:
        super().__init__()
        self.module = module
        self.input_spec = input_spec
        self.output_spec: Spec | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = unflatten(self.input_spec, list(tensors))
        buffers = buffers_before(self.module)
        given = contents((args, kwargs))
        with user_forward():
            out = self.module(*args, **kwargs)
        refuse_changed_containers(given, contents((args, kwargs)))
        # self.ema = ..., self.aux_loss = ...: an extra output, set on the module after each run.
        assigned = take_attribute_assignments(self.module, buffers)
        flat, value_spec = flatten_outputs(out)
        flat, self.output_spec = with_assigned_attributes(flat, value_spec, assigned)
        return tuple(flat)


def _input_aliasing(inputs: list[torch.Tensor], state: list[torch.Tensor]) -> tuple[int, ...]:
    """Per input: the position of the first earlier input sharing its storage, ``-2 - j`` where it
    shares the storage of the model's tensor ``j`` (``model(x, model.memory[r])``), else -1."""
    first: dict[tuple[str, int], int] = {}
    held: dict[int, int] | None = None
    aliasing = []
    for position, tensor in enumerate(inputs):
        if tensor.layout != torch.strided or not tensor.numel():
            aliasing.append(-1)
            continue
        pointer = tensor.untyped_storage().data_ptr()
        storage = (str(tensor.device), pointer)
        if storage in first:
            aliasing.append(first[storage])
            continue
        first[storage] = position
        if held is None:  # the model's storages, read once per call (an input with elements)
            held = {p: j for j, t in enumerate(state) if (p := _storage_pointer(t)) is not None}
        j = held.get(pointer)
        aliasing.append(-2 - j if j is not None and state[j].device == tensor.device else -1)
    return tuple(aliasing)


def _storage_pointer(tensor: torch.Tensor) -> int | None:
    if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, nn.Parameter):
        return None  # a subclass (a DTensor's storage is invalid to read): refused elsewhere
    return tensor.untyped_storage().data_ptr()


def _sharing_memory(aliasing: tuple[int, ...]) -> list[int]:
    """The positions of the inputs that share memory with another input or the model's tensor."""
    return sorted({i for i, a in enumerate(aliasing) if a != -1} | {a for a in aliasing if a >= 0})


def _alias_layouts(inputs: list[torch.Tensor], positions: Iterable[int]) -> tuple[Any, ...]:
    """Where each of these inputs lies in its memory (storage offset, strides), and the first input
    that is the same tensor object: what AOTAutograd bakes into a graph whose forward writes inputs
    that share memory (it remakes them as views of one merged base)."""
    return tuple(
        (
            i,
            inputs[i].storage_offset(),
            inputs[i].stride(),
            next(j for j, t in enumerate(inputs) if t is inputs[i]),
        )
        for i in positions
    )


class GraphKey(NamedTuple):
    """Everything besides sizes that a captured graph depends on; a step looks its graph up by it."""

    spec: Spec  # input structure and constant arguments
    inputs: tuple[Any, ...]  # dtype, rank, device, requires_grad of each input tensor
    training: bool  # the model's own flag (every submodule's is in ``state``)
    grad_enabled: bool
    autocast: tuple[Any, ...]
    # The dtype of the tensors the forward makes without naming one (torch.zeros(n), arange / 10),
    # which the graph holds as constants: torch.set_default_dtype between steps needs another graph.
    default_dtype: torch.dtype
    # torch.use_deterministic_algorithms: AOTAutograd's backward refuses to run under it when its
    # forward was captured without it, so switching it on between steps needs another graph.
    deterministic: bool
    opaque_functions: bool
    state: tuple[Any, ...]  # the model: see ortrain.ortmodule.guards
    # Per input tensor, the position of the first earlier input sharing its storage, -2 - j where it
    # shares the model's tensor j's, or -1: a graph captured for ``m(b, b)`` treats the two as one
    # tensor and must not run distinct ones.
    aliasing: tuple[int, ...] = ()
    # torch.inference_mode: a forward may branch on torch.is_inference_mode_enabled(), and a graph
    # captured under no_grad ran under inference_mode (wave 43: the other branch, silently).
    inference_mode: bool = False
    # torch.backends.mha.set_fastpath_enabled: nn.TransformerEncoder's eval forward packs padded
    # positions to zeros on the fast path only (capture/encoder_padding_fast_path.py), so a switch
    # between calls needs the other graph (wave 49's review: the padded outputs stayed zeros).
    mha_fastpath: bool = True
    # The environment variables the model's captures read (``os.getenv("HEAD")``), with their values
    # now (None: unset): a graph holds the branch its values chose (capture/environment_reads.py).
    environment: tuple[tuple[str, str | None], ...] = ()
    # (id, guards.read_state key) of each module the captures' forwards called that the model
    # does not hold (``DROP = nn.Dropout(p)`` at module level, ``self.aux = [Temperature()]``):
    # its plain attributes and ``training`` are baked into the graph like a submodule's.
    unheld: tuple[tuple[int, Any], ...] = ()

    @property
    def inputs_alias(self) -> bool:
        """Whether two of the call's inputs, or an input and the model's tensor, share storage."""
        return any(first != -1 for first in self.aliasing)


@dataclass
class _CompiledEntry:
    capture: Capture
    sizes: list[tuple[int | None, ...]]  # per input: fixed size, or None where dynamic
    output_spec: Spec
    binding: list[int]  # per tensor the graph binds: its position in ModelState.tensors
    # The buffers its forward writes, for a recompute under create_graph=True (second_order.py).
    buffer_writes: BufferWrites = field(default_factory=BufferWrites)
    # Whether its graphs call Python objects (but ortrain's recurrent layers): a reentrant
    # checkpoint among them refuses the autograd.grad that second_order.py's backward runs, so
    # such graphs keep AOTAutograd's node.
    python_ops: bool = False
    # Inputs sharing memory that the graphs write (``labels.masked_fill_`` on ``stream[:, i + 1:]``
    # next to ``stream[:, i:]``, a view of a buffer the forward updates): AOTAutograd remade them
    # from one merged base with the layouts they had at capture, so the graph holds for those
    # layouts only (wave 43: windows at other offsets ran on the first window's memory, silently).
    # None until the first run shows whether such inputs are written.
    alias_layouts: tuple[Any, ...] | None = None
    alias_writes_known: bool = False

    def learn_alias_writes(
        self, inputs: list[torch.Tensor], positions: list[int], versions: list[int]
    ) -> None:
        """After the first run: if it wrote into the inputs at ``positions``, which share memory
        (their version counters, which views share with their base, moved from ``versions``), the
        graph holds for their layouts only."""
        self.alias_writes_known = True
        if any(inputs[i]._version != v for i, v in zip(positions, versions, strict=True)):
            self.alias_layouts = _alias_layouts(inputs, positions)

    def matches(self, inputs: list[torch.Tensor]) -> bool:
        if self.alias_layouts is not None:
            positions = [layout[0] for layout in self.alias_layouts]
            if _alias_layouts(inputs, positions) != self.alias_layouts:
                return False
        for tensor, pattern in zip(inputs, self.sizes, strict=True):
            for size, fixed in zip(tensor.shape, pattern, strict=True):
                if fixed is not None and size != fixed:
                    return False
        return self.capture.size_guards(inputs)


def _autocast_state() -> tuple[Any, ...]:
    state: tuple[Any, ...] = ()
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            state += (device, torch.get_autocast_dtype(device))
    return state


def _forward_rewrites(options: RuntimeOptions) -> list[ForwardRewrite]:
    return forward_rewrites(
        compute_optimizer=options.enable_compute_optimizer,
        sparse_optimizer=options.enable_sparse_optimizer,
        embedding_sparse_optimizer=options.enable_embedding_sparse_optimizer,
        memory_opt_level=options.memory_opt_level,
        fuse_linear_cross_entropy=options.fuse_linear_cross_entropy,
    )


class ORTModule(nn.Module):
    """Train ``module`` on ONNX Runtime.

    Parameters, buffers and ``state_dict`` keys are the wrapped module's own, so optimizers,
    checkpoints and wrappers such as DistributedDataParallel see the model they expect.
    """

    # The model's own tables, read live (ortrain.ortmodule.shared_registries): code that writes
    # them directly (prepare_qat's ``module._modules[name] = ...``) changes the model.
    _parameters = ModelTable()
    _buffers = ModelTable()
    _modules = ModelTable()
    _non_persistent_buffers_set = ModelTable()
    _load_state_dict_post_hooks = ModelPostHooks()

    def __new__(cls, module: nn.Module | None = None, *args: Any, **kwargs: Any) -> ORTModule:
        # A subclass per wrapped class, whose class-level forward shows the wrapped class's
        # signature: the HF Trainer reads label names off type(model) (see signature.py).
        return super().__new__(wrapper_class_for(cls, module))

    def __init__(self, module: nn.Module, debug_options: DebugOptions | None = None) -> None:
        refuse_data_parallel_inside(module)
        if not isinstance(module, nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, not {type(module).__name__}")
        if debug_options is not None and not isinstance(debug_options, DebugOptions):
            raise TypeError(
                "ORTModule's second argument is an ortrain.DebugOptions, not "
                f"{type(debug_options).__name__}: ORTModule(model, DebugOptions(save_onnx=True))"
            )
        super().__init__()
        debug = (debug_options or DebugOptions()).with_environment()
        options = runtime_options()
        object.__setattr__(self, "_ortrain_module", module)
        object.__setattr__(self, "_ortrain_debug", debug)
        object.__setattr__(self, "_ortrain_options", options)
        # One for every capture: it remembers what it warned about (once per wrapper).
        memory = MemoryOptimizerConfig(options.memory_opt_level, options.memory_opt_config)
        object.__setattr__(self, "_ortrain_memory", memory)
        object.__setattr__(self, "_ortrain_graphs", GraphCache(options.graph_cache_size))
        object.__setattr__(self, "_ortrain_reads", AttributeReads())
        # The environment variables any capture of the model read (keys of GraphKey.environment).
        object.__setattr__(self, "_ortrain_environment", {})
        # The modules the captures' forwards called that the model does not hold (GraphKey.unheld),
        # weakly, by id.
        object.__setattr__(self, "_ortrain_unheld", {})
        object.__setattr__(self, "_ortrain_fallback", FallbackManager(options.fallback_policy))
        object.__setattr__(self, "_ortrain_scalars", ScalarLifter())
        object.__setattr__(self, "_ortrain_graph_breaks", None)
        object.__setattr__(self, "_ortrain_changed_by_capture", False)
        object.__setattr__(self, "_ortrain_forward_lock", threading.RLock())
        configure_log_output(
            python_log_level(debug.log_level),
            inspector_prints=options.print_input_density or options.print_memory_stats,
        )
        # After the log output is set up: ORTMODULE_LOG_LEVEL filters these lines too (wave 41:
        # they went to Python's last-resort handler, unprefixed, at any level).
        announce_inactive_options(options)
        reuse_freed_memory(options.reuse_freed_memory, user_malloc_setting())
        register_hf_cache_types()
        self._init_inspector(options)

    def _init_inspector(self, options: RuntimeOptions) -> None:
        inspector = RuntimeInspector(
            print_input_density=options.print_input_density, print_memory_stats=options.print_memory_stats
        )
        object.__setattr__(self, "_ortrain_inspector", inspector)
        weakref.finalize(self, inspector.finish)

    @property
    def inspector(self) -> RuntimeInspector:
        """Input density and memory figures (ORTMODULE_PRINT_INPUT_DENSITY / _PRINT_MEMORY_STATS)."""
        return self._ortrain_inspector

    def op_tuning(self) -> list[dict[str, Any]]:
        """Op tuning of each captured graph (see :mod:`ortrain.runtime.placement_tuning`): ``graph``
        ("forward", "backward"), ``tuning`` (still measuring), ``placement`` (in use, None while
        tuning) and ``measured_ms`` (median call time of each placement tried)."""
        return [runner.summary() for _, runner in self.graph_runners() if isinstance(runner, TunedRunner)]

    def graph_runners(self) -> Iterator[tuple[str, Any]]:
        """``(graph, runner)`` for each captured graph: graph "forward" or "backward", runner its
        :class:`~ortrain.runtime.graph_executor.PlanRunner` (a ``TunedRunner`` under op tuning)."""
        for entries in self._ortrain_graphs.values():
            for entry in entries:
                for name, slot in (("forward", entry.capture.forward), ("backward", entry.capture.backward)):
                    runner = getattr(slot, "runner", None)
                    if runner is not None:
                        yield name, runner

    # ---- the wrapped module's own objects --------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._ortrain_module

    # The wrapped module's flag, read and written through the wrapper: until wave 44 the wrapper
    # kept a flag of its own, and `wrapped.training = False` left the model in training mode (its
    # `self.training` branches took the training path), while `wrapped.module.eval()` left
    # `wrapped.training` True.
    @property  # type: ignore[override]
    def training(self) -> bool:
        module = self.__dict__.get("_ortrain_module")
        return module.training if module is not None else self.__dict__.get("_ortrain_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        module = self.__dict__.get("_ortrain_module")
        if module is not None:
            module.training = mode
        self.__dict__["_ortrain_training"] = mode

    def __getattr__(self, name: str) -> Any:
        if name in _OWN_ATTRIBUTES:
            return object.__getattribute__(self, name)
        return getattr(self._ortrain_module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # DeepSpeed ZeRO-3's hooks keep their bookkeeping on the module they hook, the wrapper:
        # its state, not the model's, so it neither reaches the wrapped module nor drops the graphs.
        # So do the calls of the wrapper itself (see _CALL_ATTRIBUTES).
        if name == "__class__":
            refuse_fsdp_wrapper_class(value)
        if name in _OWN_ATTRIBUTES or name in _CALL_ATTRIBUTES or is_deepspeed_hook_state(name):
            object.__setattr__(self, name, value)
            return
        keyed = _keyed_by_the_guards(getattr(self._ortrain_module, name, _ABSENT), value)
        setattr(self._ortrain_module, name, value)
        # The model changed under us: whatever was captured may no longer describe it. A plain
        # value replacing a plain value, or a tensor a tensor, needs nothing dropped: the guards
        # key each module's plain attributes and its tensors' dtypes, shapes, requires_grad,
        # classes and layouts, and tensors are bound afresh at every step (until wave 44 the same
        # value set again dropped every graph; until wave 46 a GAN's `model.phase = "d"/"g"` and
        # pruning's mask applied to the root's weight at every step captured at every step).
        if not keyed:
            self._invalidate(f"attribute {name!r} was set through the ORTModule")

    def __delattr__(self, name: str) -> None:
        refuse_root_parametrization(self._ortrain_module, name, sys._getframe(1))
        delattr(self._ortrain_module, name)
        self._invalidate(f"attribute {name!r} was deleted through the ORTModule")

    def _invalidate(self, why: str) -> None:
        """Drop every graph; ``why`` is the reason the next capture logs (until wave 53 it said
        "first call" after a change made through the wrapper)."""
        self._ortrain_graphs.clear(why)
        self._ortrain_fallback.graphs_in_pytorch.clear()  # the changed model may capture

    def reset_graphs(self) -> None:
        """Drop every captured graph and its sessions; the next call captures again.

        Changes ortrain sees by itself (parameters, submodules, modes, plain attributes, dtypes) do
        not need this; state kept in other objects (a Hugging Face ``config``) does.
        """
        self._invalidate("reset_graphs() was called")

    # Copies and pickles carry the model and the options, not the graphs: ONNX Runtime sessions
    # cannot be copied, and a copy has parameters of its own to capture with.
    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script(wrapped)`` scripts the model itself (the wrapper's forward is not
        TorchScript)."""
        return self._ortrain_module

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in (
            "_ortrain_graphs",
            "_ortrain_reads",
            "_ortrain_environment",
            "_ortrain_unheld",
            "_ortrain_scalars",
            "_ortrain_inspector",
            "_ortrain_forward_lock",
        ):
            state.pop(name, None)
        state["_ortrain_graph_breaks"] = None
        state["_ortrain_fallback"] = FallbackManager(self._ortrain_fallback.policy)
        return state

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Name ORTModule and the wrapped class, not the subclass made for it (not importable).
        return new_wrapper, (base_wrapper_class(type(self)), type(self._ortrain_module)), self.__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        object.__setattr__(self, "_ortrain_graphs", GraphCache(self._ortrain_options.graph_cache_size))
        object.__setattr__(self, "_ortrain_reads", AttributeReads())
        object.__setattr__(self, "_ortrain_environment", {})
        object.__setattr__(self, "_ortrain_unheld", {})
        object.__setattr__(self, "_ortrain_scalars", ScalarLifter())
        object.__setattr__(self, "_ortrain_forward_lock", threading.RLock())
        self._init_inspector(self._ortrain_options)

    # Registering goes to the wrapped module too: on the wrapper, the new state would be invisible
    # to the model's forward and to its state_dict.
    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        self._ortrain_module.register_buffer(name, tensor, persistent)
        self._invalidate(f"buffer {name!r} was registered through the ORTModule")

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        self._ortrain_module.register_parameter(name, param)
        self._invalidate(f"parameter {name!r} was registered through the ORTModule")

    def add_module(self, name: str, module: nn.Module | None) -> None:
        self._ortrain_module.add_module(name, module)
        self._invalidate(f"submodule {name!r} was added through the ORTModule")

    register_module = add_module

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        return self._ortrain_module.named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._ortrain_module.parameters(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        return self._ortrain_module.named_buffers(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self._ortrain_module.buffers(recurse)

    def named_children(self):  # type: ignore[override]
        return self._ortrain_module.named_children()

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):  # type: ignore[override]
        return self._ortrain_module.named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._ortrain_module.state_dict(*args, **kwargs)

    # The state dict is the wrapped module's, so are its hooks: registered on the wrapper they
    # were never called (wave 42: an extra entry a post hook adds was missing from checkpoints).
    def register_state_dict_pre_hook(self, hook: Any) -> Any:
        return self._ortrain_module.register_state_dict_pre_hook(hook)

    def register_state_dict_post_hook(self, hook: Any) -> Any:
        return self._ortrain_module.register_state_dict_post_hook(hook)

    def _register_state_dict_hook(self, hook: Any) -> Any:
        return self._ortrain_module._register_state_dict_hook(hook)

    def register_load_state_dict_pre_hook(self, hook: Any) -> Any:
        return self._ortrain_module.register_load_state_dict_pre_hook(hook)

    def _register_load_state_dict_pre_hook(self, hook: Any, with_module: bool = False) -> Any:
        return self._ortrain_module._register_load_state_dict_pre_hook(hook, with_module)

    def register_load_state_dict_post_hook(self, hook: Any) -> Any:
        return self._ortrain_module.register_load_state_dict_post_hook(hook)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return self._ortrain_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(  # type: ignore[override]
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A parent's load_state_dict reaches the wrapper: the model's own tensors load here, its
        # submodules through the parent's walk over the tables the wrapper shares with it.
        self._ortrain_module._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def apply(self, fn: Any) -> ORTModule:  # type: ignore[override]
        # fn meets the model itself (an init keyed on its class), not the wrapper.
        self._ortrain_module.apply(fn)
        return self

    def train(self, mode: bool = True) -> ORTModule:
        self._ortrain_module.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ORTModule:  # type: ignore[override]
        self._ortrain_module._apply(fn, recurse)
        return self

    def extra_repr(self) -> str:
        return f"module={type(self._ortrain_module).__name__}"

    def __repr__(self) -> str:
        return f"ORTModule({self._ortrain_module!r})"

    # ---- running -------------------------------------------------------------------------------
    @wrapped_module_signature  # libraries that inspect forward (the HF Trainer) see the model's own
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if capturing():  # inside another capture, on this thread: part of its graph, see _forward
            return self._forward(args, kwargs)
        if torch.compiler.is_dynamo_compiling():
            # Traced by TorchDynamo (an outer model on its graph-break path, torch.compile): no
            # lock, which TorchDynamo cannot enter (wave 49's review: an ORTModule inside one
            # with a hook was refused, "Dynamo does not know how to enter a RLock"); see _forward.
            return self._forward(args, kwargs)
        # One forward at a time per wrapper: a capture swaps the model's parameters for fake ones
        # while it traces, which another thread's forward of the same model would read (threads
        # that met a new input shape at once failed on fake tensors and fell back to PyTorch).
        # Backward passes run outside the lock: they read what their forward saved.
        with self._ortrain_forward_lock:
            return self._forward(args, kwargs)

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fallback: FallbackManager = self._ortrain_fallback
        if fallback.active:
            return self._ortrain_module(*args, **kwargs)
        if torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export():
            # TorchScript's tracer finds parameters in each module's own registry, and the wrapper
            # keeps the model's out of its own: they became constants ("Cannot insert a Tensor
            # that requires grad as a constant"), or, under no_grad, silently frozen weights.
            raise RuntimeError(
                "torch.jit.trace of an ORTModule: trace the model it wraps, "
                "torch.jit.trace(wrapped.module, ...), which holds the trained parameters; "
                "torch.export.export(wrapped, ...), torch.jit.script(wrapped) and "
                "torch.onnx.export(wrapped, ...) take the wrapper as it is"
            )
        if torch.compiler.is_exporting() or torch.jit.is_tracing():
            # Exporting the trained model (torch.export, torch.onnx.export): the exporter traces
            # the model's own forward, as if it were not wrapped (ortrain's graphs ran as one
            # opaque call, and torch.export failed on the wrapper's forward).
            return self._ortrain_module(*args, **kwargs)
        if torch.compiler.is_dynamo_compiling():
            # torch.compile(ORTModule(model)): Dynamo traces through the wrapper, and its backend
            # compiles the model; ortrain's graphs would run on Dynamo's traced values. (Under
            # ortrain's own graph-break path, a wrapper nested in the model is part of its graphs:
            # no torch.compile of the user's to advise against, wave 45's review.)
            if not inside_graph_break_path():
                _warn_once_compiled_around()
            return self._ortrain_module(*args, **kwargs)
        if functorch_transform_active():
            _warn_once_under_transforms()
            return self._ortrain_module(*args, **kwargs)
        if carries_tangents((args, kwargs), self._ortrain_module):
            _warn_once_under_forward_ad()
            return self._ortrain_module(*args, **kwargs)
        if capturing():  # inside the model another capture traces: part of its graph
            return self._ortrain_module(*args, **kwargs)
        if parametrizations_cached(self._ortrain_module):
            _info_once_under_parametrization_cache()
            return self._ortrain_module(*args, **kwargs)
        try:
            zero3 = zero3_parameters(self._ortrain_module)
            if not zero3:
                return self._run_on_ort(args, kwargs)
            with zero3_gathered(self._ortrain_module, zero3) as for_backward:
                outputs = self._run_on_ort(args, kwargs)
            return for_backward(outputs)
        except ORTModuleFallbackException as error:
            if isinstance(error, ORTModuleIOError | ORTModuleDeviceException):
                return self._refused_inputs(error, args, kwargs)
            fallback.handle(error)
            self._invalidate("the model fell back to PyTorch")  # from now on: free the sessions
            return self._ortrain_module(*args, **kwargs)

    def _refused_inputs(
        self,
        error: ORTModuleIOError | ORTModuleDeviceException,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Inputs ortrain's own checks refuse. Those eager PyTorch rejects too (a NumPy array, a
        tensor on another device) are the user's to fix: PyTorch's own error, and the model keeps
        its graphs (until wave 44 one such batch sent it to PyTorch for good, with a warning
        blaming ortrain). The forward runs once either way: where the policy lets PyTorch take
        over, this call's own run answers the question (the eager check would have been a second
        run of the forward's Python side effects)."""
        fallback: FallbackManager = self._ortrain_fallback
        if not fallback.policy & error.policy:
            self._raise_if_user_error(args, kwargs)  # leaves no trace
            raise error
        if isinstance(error, GeneratorInputError):
            # This call's alone: the calls without a generator stay on the graphs (until wave 53
            # one call with a generator sent the model to PyTorch for good).
            _warn_once_generator_input(error.where)
            return self._ortrain_module(*args, **kwargs)
        outputs = self._ortrain_module(*args, **kwargs)  # raises PyTorch's error, nothing switched
        fallback.handle(error)
        self._invalidate("the model fell back to PyTorch")  # from now on: free the sessions
        return outputs

    def _run_on_ort(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._ortrain_graph_breaks is not None:
            return self._ortrain_graph_breaks(args, kwargs)
        call, state, key = self._guard(args, kwargs)
        if key in self._ortrain_fallback.graphs_in_pytorch:
            return self._ortrain_module(*args, **kwargs)
        if state.uninitialized:
            logger.info("lazy modules have no parameters yet: this step runs in PyTorch, which makes them")
            return self._ortrain_module(*args, **kwargs)
        cache: GraphCache[_CompiledEntry] = self._ortrain_graphs
        entry = cache.lookup(key, lambda e: e.matches(call.inputs))
        if entry is not None and _unheld_modules_hooked(entry.capture):
            entry = None  # its capture fails, naming them, and the model takes the graph breaks
        # A failure may be the user's (a wrong shape or dtype, or two sizes a dynamic graph saw
        # equal that now differ): then PyTorch's own error is the one to show. Only when eager
        # PyTorch accepts the inputs is it ortrain's failure, for the fallback policy to judge.
        if entry is None:
            # Devices are part of the key: a graph that fits ran on these devices before.
            devices = {t.device for t in (*call.inputs, *state.tensors)}
            if len(devices) > 1:  # each device gets its executors (runtime/selection.py); one at a time
                raise ORTModuleDeviceException(
                    f"ortrain runs a graph on one device; got tensors on {devices}"
                )
            if self._hooks_need_graph_breaks():
                return self._run_on_ort(args, kwargs)
            reason = self._why_no_graph_fits(key)
            snapshot = ModuleSnapshot(self._ortrain_module)
            reads_before = self._ortrain_reads.version
            changes: list[Any] = []  # restore() itself may raise: its error, not an unbound name
            try:
                try:
                    with self._ortrain_reads.reaching(snapshot.record_reached):
                        entry = self._compile(key, call.inputs, cache.group(key), state, reason)
                finally:
                    changes = snapshot.restore()  # tracing must not leave fake values behind
            except _SizedOnFirstUse as sized:
                return self._after_a_capture_changed_the_model(sized.changes, args, kwargs)
            except Exception:
                if changes:  # the traces saw each other's changes (fake values of another trace)
                    logger.debug("the capture that changed the model failed", exc_info=True)
                    return self._after_a_capture_changed_the_model(changes, args, kwargs)
                if call.lifted:
                    # Perhaps the model needs a changing number as a Python number: bake it in.
                    self._ortrain_scalars.refuse(call)
                    return self._run_on_ort(args, kwargs)
                # Before the eager check: that would run the forward's Python once more (its
                # side effects, its random draws), and TorchDynamo raises the user's errors too.
                if self._switch_to_graph_breaks():
                    return self._run_on_ort(args, kwargs)
                self._raise_if_user_error(args, kwargs)
                failure = sys.exc_info()[1]
                if (
                    cache
                    and isinstance(failure, ORTModuleFallbackException)
                    and self._ortrain_fallback.handle_one_graph(key, failure)
                ):
                    return self._ortrain_module(*args, **kwargs)
                raise
            if changes:
                return self._after_a_capture_changed_the_model(
                    changes, args, kwargs, bounded_deque=snapshot.bounded_deque_changed
                )
            object.__setattr__(self, "_ortrain_changed_by_capture", False)
            unread = unread_lifted_inputs(call, entry.capture, key.inputs_alias) if call.lifted else None
            if unread:
                self._ortrain_scalars.refuse(call, why="unread", unread=unread)
                return self._run_on_ort(args, kwargs)
            kept_under = self._key_after_capture(key, reads_before, entry.capture)
            if kept_under is not None:
                cache.add(kept_under, entry, reason)
                key = kept_under  # the state the capture left: what a recompute compares with
        state_tensors = [state.tensors[i] for i in entry.binding]
        if self._ortrain_inspector.enabled:
            self._ortrain_inspector.on_forward(
                entry.capture, call.spec, self._ortrain_module.forward, call.inputs
            )
        entry.capture.refuse_writes_into_leaves(call.inputs)
        learning = key.inputs_alias and not entry.alias_writes_known
        shared = _sharing_memory(key.aliasing) if learning else []
        versions = [call.inputs[i]._version for i in shared]
        # BatchNorm's running statistics keep their version counters, as after eager's kernel
        # (ortrain.capture.running_statistics).
        kept = functools.partial(entry.capture.statistics_versions_kept, state_tensors, call.inputs)
        try:
            outputs = None
            if needs_second_order_path() and not entry.capture.mutated_inputs and not entry.python_ops:
                n_state = len(state_tensors)
                outputs = run_twice_differentiable(
                    lambda tensors: entry.capture(tensors[:n_state], tensors[n_state:]),
                    self._ortrain_module,
                    (args, kwargs),
                    entry.buffer_writes,
                    (*state_tensors, *call.inputs),
                    functools.partial(self._change_since, key.state),
                    assigned_tensor_paths(entry.output_spec),
                    versions_kept=kept,
                )
            if outputs is None:
                with kept():
                    outputs = entry.capture(state_tensors, call.inputs)
                if entry.capture.mutated_inputs:
                    why = WRITES_ITS_INPUT
                else:
                    why = CALLS_PYTHON if entry.python_ops else READS_AN_OUTSIDE_TENSOR
                watch_for_create_graph(outputs, why)
            if key.autocast:
                watch_for_backward_under_autocast(outputs)
        except RECOMPUTATION_STOPS:
            raise
        except Exception as error:
            self._raise_if_user_error(args, kwargs)
            raise ORTModuleONNXModelException(
                f"ONNX Runtime failed to run the forward graph: {type(error).__name__}: {error}"
            ) from error
        if learning:
            entry.learn_alias_writes(call.inputs, shared, versions)
        spec = entry.output_spec
        if isinstance(spec, AssignedAttributes):
            values = len(outputs) - spec.extra_outputs
            assign_attributes(self._ortrain_module, spec, outputs[values:])
            return unflatten(spec.value_spec, list(outputs[:values]))
        return unflatten(spec, list(outputs))

    def _key_after_capture(self, key: GraphKey, reads_before: int, captured: Capture) -> GraphKey | None:
        """The key to keep a new graph under: the model's state as the capture left it, which
        watches the attributes of held objects the capture read (and only those: see
        :mod:`ortrain.capture.attribute_reads`), with the values the forward set on its own
        configuration while it was traced (Hugging Face's sequence classifiers set
        ``config.problem_type`` on their first call). Such values are taken as the forward's own
        initialization, as they were before configs were watched; a graph kept under the old values
        would be captured again at the next step. Where the capture changed more than values,
        ``key``; or None (the graph serves this call only) where ``key`` misses names the capture read.
        The environment variables the capture read join the key, with the values it saw."""
        if captured.environment:
            self._ortrain_environment.update(dict.fromkeys(name for name, _ in captured.environment))
            names = self._ortrain_environment
            # The values the capture saw; those of the variables it did not read, as they are now.
            values = dict(model_environment(names)) | dict(key.environment) | dict(captured.environment)
            key = key._replace(environment=tuple((name, values[name]) for name in names))
        for ref in captured.unheld_modules:
            module = ref()
            known = self._ortrain_unheld.get(id(module))
            if module is not None and (known is None or known() is not module):
                self._ortrain_unheld[id(module)] = ref
        if self._ortrain_unheld:
            key = key._replace(unheld=self._unheld_state())
        after = read_state(self._ortrain_module, self._ortrain_reads).key
        if after == key.state:
            return key
        if without_config_values(after) != without_config_values(key.state):
            return key if self._ortrain_reads.version == reads_before else None
        logger.debug(
            "the graph is kept under the state the capture left (configuration values it set, "
            "held objects' attributes it did not read left out)"
        )
        return key._replace(state=after)

    def _unheld_state(self) -> tuple[tuple[int, Any], ...]:
        """GraphKey.unheld: (id, state) of each module the captures called outside the model, alive."""
        states = []
        for module_id, ref in list(self._ortrain_unheld.items()):
            module = ref()
            if module is None:
                del self._ortrain_unheld[module_id]  # a graph that called it captures again
            else:
                states.append((module_id, read_state(module, self._ortrain_reads).key))
        return tuple(states)

    def _guard(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[LiftedCall, ModelState, GraphKey]:
        """This step's inputs, the model's tensors, and the key of the graph that fits them."""
        flat_inputs, flat_spec = flatten_inputs(args, kwargs)
        call = self._ortrain_scalars.lift(flat_spec, flat_inputs)
        state = read_state(self._ortrain_module, self._ortrain_reads)
        key = GraphKey(
            spec=call.spec,
            inputs=tuple(tensor_signature(t) for t in call.inputs),
            training=self._ortrain_module.training,
            grad_enabled=torch.is_grad_enabled(),
            autocast=_autocast_state(),
            default_dtype=torch.get_default_dtype(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            opaque_functions=custom_autograd_enabled(self._ortrain_options.enable_custom_autograd),
            state=state.key,
            aliasing=_input_aliasing(call.inputs, state.tensors),
            inference_mode=torch.is_inference_mode_enabled(),
            mha_fastpath=torch.backends.mha.get_fastpath_enabled(),
            environment=model_environment(self._ortrain_environment),
            unheld=self._unheld_state() if self._ortrain_unheld else (),
        )
        return call, state, key

    def _change_since(self, state_key: Any) -> str | None:
        """What changed in the model since its state's key was ``state_key`` that a recompute of
        the forward would run differently, or None: its modules, their training flags and hooks,
        and the global hooks. (Its tensors aside: a recompute binds the call's own, which
        ``torch.func.functional_call`` swaps. Other attributes too: a training loop sets its own,
        ``model.last_loss = ...``, between the forward and the penalty, which the regression
        review found refused.)"""
        before = _recompute_relevant(state_key)
        now = _recompute_relevant(read_state(self._ortrain_module, self._ortrain_reads).key)
        return None if now == before else describe_change(self._ortrain_module, before, now)

    def _why_no_graph_fits(self, key: GraphKey) -> str:
        """Name, in the user's terms, what differs from the graph used last (for logs and warnings)."""
        cache: GraphCache[_CompiledEntry] = self._ortrain_graphs
        last = cache.last_key
        if last is None:
            return cache.cleared_because or "first call"
        assert isinstance(last, GraphKey)
        if last == key:
            if any(entry.alias_layouts is not None for entry in cache.group(key)):
                return (
                    "inputs that share memory and that the forward writes lie elsewhere in it (other "
                    "storage offsets or strides: pass a .clone() of the written one to share a graph)"
                )
            return "input sizes changed"
        if last.state != key.state:
            return describe_change(self._ortrain_module, last.state, key.state)
        if last.environment != key.environment:
            return _environment_change(last.environment, key.environment)
        if last.unheld != key.unheld:
            return self._unheld_change(last.unheld, key.unheld)
        if last.spec != key.spec:
            return _describe_input_change(last.spec, key.spec)
        if last.inputs != key.inputs:
            places = [place for place, leaf in call_leaves(key.spec) if leaf[0] == "tensor"]
            for place, before, after in zip(places, last.inputs, key.inputs, strict=True):
                if before != after:
                    return f"{place} changed from {_show_signature(before)} to {_show_signature(after)}"
        if last.grad_enabled != key.grad_enabled:
            return "gradient mode changed" + (" (torch.no_grad)" if not key.grad_enabled else "")
        if last.autocast != key.autocast:
            return f"autocast changed from {last.autocast or 'off'} to {key.autocast or 'off'}"
        if last.default_dtype != key.default_dtype:
            return f"the default dtype changed from {last.default_dtype} to {key.default_dtype}"
        if last.deterministic != key.deterministic:
            return "torch.use_deterministic_algorithms was switched " + ("on" if key.deterministic else "off")
        if last.aliasing != key.aliasing:
            return "inputs that share memory changed (the same tensor passed twice, or views of one tensor)"
        if last.inference_mode != key.inference_mode:
            return "torch.inference_mode was switched " + ("on" if key.inference_mode else "off")
        if last.mha_fastpath != key.mha_fastpath:
            return "torch.backends.mha's fast path was switched " + ("on" if key.mha_fastpath else "off")
        return "custom autograd support was switched " + ("on" if key.opaque_functions else "off")

    def _unheld_change(self, before: tuple[tuple[int, Any], ...], after: tuple[tuple[int, Any], ...]) -> str:
        """What changed in a module the forward calls that the model does not hold."""
        was = dict(before)
        for module_id, state in after:
            ref = self._ortrain_unheld.get(module_id)
            module = ref() if ref is not None else None
            if module_id in was and was[module_id] != state and module is not None:
                change = describe_change(module, was[module_id], state, root_name=type(module).__name__)
                return f"{change} (a module the forward calls that the model does not hold)"
        return "the forward calls other modules that the model does not hold"

    def _dynamic_dims(
        self, inputs: list[torch.Tensor], entries: list[_CompiledEntry], siblings: list[_CompiledEntry]
    ) -> dict[int, tuple[int, ...]]:
        """Sizes that differ from an earlier capture, or were dynamic in one, become dynamic; none
        where a graph writes inputs that share memory (AOTAutograd's merged base of such inputs
        failed to trace with open sizes: each size captures on its own).

        ``siblings``: the graphs of the same call with other values of the numbers baked in (an int
        the model needs as a Python number: a GNN batch's graph count). The sizes those needed
        open are open from this value's first capture on: each value captured twice (its sizes
        fixed, then open) where the batches' sizes change at every step (wave 47's review: 17
        captures in 40 steps of a GCN)."""
        if any(entry.alias_layouts is not None for entry in (*entries, *siblings)):
            return {}
        dims: dict[int, set[int]] = {}
        for entry in entries:
            for i, (tensor, pattern) in enumerate(zip(inputs, entry.sizes, strict=True)):
                for d, (size, fixed) in enumerate(zip(tensor.shape, pattern, strict=True)):
                    if fixed is None or fixed != size:
                        dims.setdefault(i, set()).add(d)
        for entry in siblings:
            for i, pattern in enumerate(entry.sizes):
                dims.setdefault(i, set()).update(d for d, fixed in enumerate(pattern) if fixed is None)
        return {i: tuple(sorted(d)) for i, d in dims.items() if d}

    def _siblings(self, key: GraphKey) -> list[_CompiledEntry]:
        """The graphs kept for this call with other values of its number arguments baked in."""
        masked = key._replace(spec=without_number_values(key.spec))

        def sibling(other: Hashable) -> bool:
            assert isinstance(other, GraphKey)
            return other != key and other._replace(spec=without_number_values(other.spec)) == masked

        if masked == key:  # no number baked in
            return []
        return self._ortrain_graphs.groups_where(sibling)

    def _compile(
        self,
        key: GraphKey,
        inputs: list[torch.Tensor],
        entries: list[_CompiledEntry],
        state: ModelState,
        reason: str,
    ) -> _CompiledEntry:
        # Capture patches process-wide state and torch.export is not thread-safe: one at a time.
        # Tracing may draw random numbers; the user's generator must not see it. No full garbage
        # collection of the whole process while compiling (0.6 s of a first step); capture and
        # export leave their objects (torch.onnx.export its example tensors) in reference cycles,
        # collected when the compile ends.
        # Graph modules generate their Python code only if something runs them in PyTorch.
        with (
            COMPILE_LOCK,
            refusing_python_randomness(self._ortrain_module),
            torch.random.fork_rng(devices=[]),
            compile_garbage_collected(),
            graph_modules_compiled_on_first_call(),
        ):
            return self._compile_locked(key, inputs, entries, state, reason)

    def _compile_locked(
        self,
        key: GraphKey,
        inputs: list[torch.Tensor],
        entries: list[_CompiledEntry],
        state: ModelState,
        reason: str,
    ) -> _CompiledEntry:
        # Gradients follow grad mode, not train()/eval(), as in eager PyTorch: a model in eval()
        # (frozen BatchNorm and dropout while fine-tuning, a saliency map of its input) still
        # differentiates. Where nothing requires grad, AOTAutograd makes an inference graph anyway.
        training = key.grad_enabled
        refuse_distributed_submodules(self._ortrain_module)
        flat_module = _FlatCall(self._ortrain_module, key.spec)
        dynamic = self._dynamic_dims(inputs, entries, self._siblings(key))
        captured, output_spec = self._capture_or_load(flat_module, key, inputs, training, dynamic, reason)
        saver = None
        debug: DebugOptions = self._ortrain_debug
        if debug.save_onnx:
            saver = StageSaver(debug.save_path, debug.onnx_prefix, "training" if training else "inference")
        passes = default_passes(compute_optimizer=self._ortrain_options.enable_compute_optimizer)
        slots: list[tuple[str, GraphSlot]] = [("forward", captured.forward)]
        if captured.backward is not None:
            slots.append(("backward", captured.backward))
        device = next((t.device for t in (*inputs, *state.tensors)), torch.device("cpu"))
        for name, slot in slots:
            slot.runner = build_tuned_graph_executor(
                slot.graph,
                name=name,
                settings=TuningSettings.of(self._ortrain_options),
                opset_version=self._ortrain_options.opset_version,
                passes=passes,
                saver=saver,
                device=device,
                policy=self._ortrain_options.fallback_policy,
                openmp_passive=openmp_wait_policy() == "PASSIVE",
                cache_dir=self._ortrain_options.cache_dir,
                segments=self._ortrain_options.backward_segments if name == "backward" else 1,
                declined=memory_level_declined(self._ortrain_options.memory_opt_level, name),
            )
        sizes = captured.input_sizes(inputs, aliased=key.inputs_alias)
        pinned = [
            f"input {i} dim {d}" for i, dims in dynamic.items() for d in dims if sizes[i][d] is not None
        ]
        if pinned:
            logger.info(
                "the model's Python fixed sizes the capture left open (%s: a len(), a loop, a Python int "
                "of a size, or an operator traced at fixed sizes, as a sparse tensor's constructor); "
                "the graph holds for these sizes only, and each new one captures again",
                ", ".join(pinned),
            )
        binding = binding_order(self._ortrain_module, captured.state_names, prefix="module")
        if self._ortrain_inspector.enabled:
            self._ortrain_inspector.attach(captured, device)
        python_ops = captured.calls_python_beyond_recurrent_layers()
        return _CompiledEntry(captured, sizes, output_spec, binding, python_ops=python_ops)

    def _capture_or_load(
        self,
        flat_module: _FlatCall,
        key: GraphKey,
        inputs: list[torch.Tensor],
        training: bool,
        dynamic: dict[int, tuple[int, ...]],
        reason: str,
    ) -> tuple[Capture, Spec]:
        """The capture and its output spec: loaded from ``ORTMODULE_CACHE_DIR``, or traced (and stored).

        The INFO lines say which, with ``reason`` (why no graph of this wrapper fitted): until wave
        53 a capture loaded from the cache was logged as "capturing a graph" and "capturing
        training graphs", and nothing said it had been loaded."""
        what = f"{'training' if training else 'inference'} graphs for {len(inputs)} input"
        what += ("" if len(inputs) == 1 else "s") + (f" with dynamic sizes {dynamic}" if dynamic else "")
        cache_dir = self._ortrain_options.cache_dir
        capture_key = self._capture_key(key, inputs, dynamic)
        if capture_key is not None and cache_dir is not None:
            loaded = load_capture(cache_dir, capture_key, training=training, dynamic_dims=dynamic)
            if loaded is not None:
                logger.info("loaded %s from the cache (ORTMODULE_CACHE_DIR), not captured: %s", what, reason)
                return loaded
        logger.info("capturing a graph: %s", reason)
        logger.info("capturing %s", what)
        if capture_key is None or cache_dir is None:
            return self._capture(flat_module, key, inputs, training, dynamic, package=False)
        captured, output_spec = self._capture(flat_module, key, inputs, training, dynamic, package=True)
        save_capture(cache_dir, capture_key, captured, output_spec, model=type(self._ortrain_module).__name__)
        return captured, output_spec

    def _capture(
        self,
        flat_module: _FlatCall,
        key: GraphKey,
        inputs: list[torch.Tensor],
        training: bool,
        dynamic: dict[int, tuple[int, ...]],
        *,
        package: bool,
    ) -> tuple[Capture, Spec]:
        classes = {type(m) for m in self._ortrain_module.modules()}
        # Every object the guards describe by value: the capture records which attributes it reads.
        described = read_state(self._ortrain_module, describe=True).described
        with refusing_generator_resets(), refusing_autograd_hooks(), memoized_functions_unwrapped(classes):
            try:
                with timed("capture"), self._ortrain_reads.recording(described):
                    captured = capture(
                        flat_module,
                        inputs,
                        training=training,
                        dynamic_dims=dynamic,
                        opaque_functions=key.opaque_functions,
                        checkpoint_ops=self._ortrain_options.allow_autograd_checkpoint,
                        skipped_functions=self._ortrain_options.skipped_autograd_functions,
                        memory=self._ortrain_memory,
                        forward_rewrites=_forward_rewrites(self._ortrain_options),
                        trace_forward_graph=self._ortrain_options.print_input_density,
                        package=package,
                    )
            except ORTModuleIOError:
                raise  # an output ortrain cannot pass back: FALLBACK_UNSUPPORTED_DATA decides
            except Exception as error:
                failure = f"capture failed: {type(error).__name__}: {error}"
                raise ORTModuleTorchModelException(failure) from error
        if flat_module.output_spec is None:
            raise ORTModuleTorchModelException("capture did not run the model's forward")
        if captured.sized_on_first_use:
            # Its trace kept the empty shape where the real forward makes a new one (a per-channel
            # observer's min/max): neither run nor stored, like a capture that changed the model.
            raise _SizedOnFirstUse(
                [
                    f"'{name.removeprefix('module.')}' has no elements and the forward writes it"
                    for name in captured.sized_on_first_use
                ]
            )
        return captured, flat_module.output_spec

    def _capture_key(
        self, key: GraphKey, inputs: list[torch.Tensor], dynamic: dict[int, tuple[int, ...]]
    ) -> str | None:
        """The key a stored capture must match (``ortrain.cache.capture_key``), or None where captures
        are not cached: no ``ORTMODULE_CACHE_DIR``, ``ORTMODULE_CACHE_CAPTURE=0``, or the input
        density inspector, which reads the traced forward graph."""
        options: RuntimeOptions = self._ortrain_options
        if options.cache_dir is None or not options.cache_capture or options.print_input_density:
            return None
        call = {
            "spec": key.spec,
            "inputs": [
                [str(t.dtype), list(t.shape), str(t.device), t.requires_grad, memory_layout(t)]
                + ([list(attributes)] if (attributes := python_attributes(t)) else [])
                for t in inputs
            ],
            "training": key.training,
            "grad enabled": key.grad_enabled,
            "inference mode": key.inference_mode,
            "aliasing": key.aliasing,
            "autocast": key.autocast,
            "opaque functions": key.opaque_functions,
            "dynamic": sorted(dynamic.items()),
        }
        return capture_key(
            self._ortrain_module, call, options=options, environment=environment_for_cache_key()
        )

    def _after_a_capture_changed_the_model(
        self,
        changes: list[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        bounded_deque: bool = False,
    ) -> Any:
        """The forward changed the model while it was traced (undone since): a cache filled on
        first use runs this step in PyTorch, so that the change happens once with real tensors,
        and the next step captures the changed model; a change at every call (the capture after
        such a step changes it again) goes to TorchDynamo's graph breaks, which replay it, except
        where it appends to a deque with a ``maxlen``, which TorchDynamo models wrongly."""
        what = _first_few(changes, 3, "; ")
        if self._ortrain_changed_by_capture and bounded_deque:
            # TorchDynamo (torch 2.13) does not drop the oldest entry when its graph appends to a
            # full bounded deque of the model: ``len(self.seen)`` read 4 for ``maxlen=3``, and the
            # loss differed from eager's, silently. The fallback policy decides (PyTorch by default).
            raise ORTModuleTorchModelException(
                f"the model's forward changes the model at every call ({what}), appending to a deque "
                "with a maxlen, which TorchDynamo's graph breaks do not replay faithfully"
            )
        if self._ortrain_changed_by_capture:
            logger.warning(
                "the model's forward changes the model at every call (%s): a captured graph cannot "
                "repeat that, so this model trains through TorchDynamo's graph breaks, which do",
                what,
            )
            self._train_through_graph_breaks()
            return self._run_on_ort(args, kwargs)
        logger.info(
            "capturing changed the model (%s); undone, and this step runs in PyTorch so that the "
            "change happens once, with real tensors; the next step captures the changed model",
            what,
        )
        object.__setattr__(self, "_ortrain_changed_by_capture", True)
        return self._ortrain_module(*args, **kwargs)

    def _hooks_need_graph_breaks(self) -> bool:
        """A forward hook of the user's would run once, on traced values: use TorchDynamo's path."""
        hooked = user_forward_hooks(self._ortrain_module)
        if not hooked:
            return False
        logger.info(
            "forward hooks on %s: a captured graph would run them once, on traced values, and never "
            "at later steps; the model trains through TorchDynamo, which runs them at every step",
            _first_few(hooked, 5, ", "),
        )
        self._ortrain_graphs.clear()  # a hook added mid-training: the graphs captured before go
        self._train_through_graph_breaks()
        return True

    def _switch_to_graph_breaks(self) -> bool:
        """After a capture failed on data-dependent Python or on tensors from outside the model:
        train through TorchDynamo's graph breaks."""
        error = sys.exc_info()[1]
        random = _first(exception_chain(error), (PythonRandomnessError, GeneratorResetError))
        if random is not None:
            # (a draw from a generator of the forward's own is refused during the trace: wrapped)
            logger.info(
                "%s; the model trains through TorchDynamo's graph breaks, which draw at every step", random
            )
        elif (changed := _first(exception_chain(error), InputMetadataChangeError)) is not None:
            logger.info(
                "%s; the model trains through TorchDynamo's graph breaks, whose runtime makes that "
                "change to the caller's tensor at every step",
                changed,
            )
        elif isinstance(error, AutogradHookError):
            logger.info(
                "%s; the model trains through TorchDynamo's graph breaks, which install it at every step",
                error,
            )
        elif (change := _first(exception_chain(error), InputContainerChange)) is not None:
            logger.info(
                "%s; the model trains through TorchDynamo's graph breaks, which make the change to the "
                "caller's containers at every step",
                change,
            )
        elif error is not None and is_data_dependent(error):
            logger.info(
                "whole-graph capture failed on data-dependent Python; splitting the model at graph breaks"
            )
        elif error is not None and in_control_flow_operator(error):
            logger.info(
                "the capture failed inside a control-flow operator (torch.cond, torch.while_loop, ...); "
                "the model trains through TorchDynamo's graphs, which hand such operators over whole"
            )
        elif (unheld := _first(exception_chain(error), UnheldModuleHooksError)) is not None:
            logger.info(
                "%s: a captured graph would run them once, on traced values, and never at later "
                "steps; the model trains through TorchDynamo, which runs them at every step",
                unheld,
            )
        elif error is not None and on_sparse_tensors(error):
            logger.info(
                "the whole-graph capture failed on a sparse tensor the forward builds; the model "
                "trains through TorchDynamo's graphs, with the sparse operators in PyTorch"
            )
        elif error is not None and reads_outside_tensors(error):
            logger.info(
                "the forward reads tensors that are not the model's parameters, buffers or tensor "
                "attributes (a module kept in a list, tensors in a list, a module-level tensor): the "
                "model trains through TorchDynamo, which passes them to the graphs at every step; "
                "registering them (nn.ModuleList, register_buffer) lets ortrain capture one graph"
            )
        else:
            return False
        logger.debug("the whole-graph capture's error", exc_info=error)
        self._train_through_graph_breaks()
        return True

    def _train_through_graph_breaks(self) -> None:
        if forward_defines_differentiating_hook(self._ortrain_module):
            raise DifferentiatingHookError("a hook defined in the forward")
        path = GraphBreakPath(self._ortrain_module, self._ortrain_debug, self._ortrain_options)
        object.__setattr__(self, "_ortrain_graph_breaks", path)

    def _raise_if_user_error(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """If eager PyTorch rejects these inputs too, raise PyTorch's own error: the user's to fix."""
        run_eagerly_leaving_no_trace(self._ortrain_module, args, kwargs)


def _recompute_relevant(state_key: Any) -> Any:
    """Of a model state's key (ortrain.ortmodule.guards.read_state): each module's identity,
    training flag and hooks, and the global hooks, in the key's own shape."""
    modules, hooks, _classes = state_key
    return (
        tuple(
            (m[0], tuple(v for v in m[1] if v[0] == "training"), m[2], (), (), (), (), ()) for m in modules
        ),
        hooks,
        (),
    )


def _environment_change(
    before: tuple[tuple[str, str | None], ...], after: tuple[tuple[str, str | None], ...]
) -> str:
    """Which environment variable the forward reads changed value (None: unset)."""
    was = dict(before)
    for name, now in after:
        if name in was and was[name] != now:
            return f"the environment variable {name} changed from {was[name]!r} to {now!r}"
    return "the forward reads other environment variables"


def _unheld_modules_hooked(capture: Capture) -> bool:
    """Whether a module the capture's forward called outside the model has hooks of the user's
    now (added after the capture: see ortrain/capture/module_paths.py)."""
    return any((m := ref()) is not None and has_users_hooks(m) for ref in capture.unheld_modules)


_ABSENT = object()


def _keyed_by_the_guards(old: Any, new: Any) -> bool:
    """Whether an attribute set through the wrapper keeps the guards' view complete: the same
    object, a plain value replacing a plain value (the state key holds both, compared exactly:
    ``-0.0`` is not ``0.0``, a NaN is a NaN, tuples and NumPy scalars by value), or a tensor
    replacing a tensor (keyed by dtype, device, shape, requires_grad, class and layout, and bound
    at every step)."""
    if old is new:
        return old is not _ABSENT
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return True
    return exact_plain_form(old) is not NOT_PLAIN and exact_plain_form(new) is not NOT_PLAIN


def _first(
    errors: Iterator[BaseException], kind: type[BaseException] | tuple[type[BaseException], ...]
) -> BaseException | None:
    return next((error for error in errors if isinstance(error, kind)), None)


def _first_few(items: list[str], most: int, separator: str) -> str:
    more = f"{separator}and {len(items) - most} more" if len(items) > most else ""
    return separator.join(items[:most]) + more


@functools.cache
def _info_once_under_parametrization_cache() -> None:
    logger.info(
        "ORTModule runs the model in PyTorch inside torch.nn.utils.parametrize.cached(), which "
        "computes each parametrized tensor once for the whole block; calls outside it run on the graphs"
    )


_compiled_around_warned = [False]


def _warn_once_compiled_around() -> None:
    if _compiled_around_warned[0]:
        return
    _compiled_around_warned[0] = True
    logger.warning(
        "torch.compile traces through ORTModule: the model runs as torch.compile's backend "
        'compiles it (on ONNX Runtime only with backend="ortrain"); call ORTModule(model) '
        'without torch.compile, or torch.compile(model, backend="ortrain")'
    )


@functools.cache
def _warn_once_under_transforms() -> None:
    logger.warning(
        "ORTModule runs the model in PyTorch under torch.func transforms (vmap, grad, jacrev, ...): "
        "their wrapped tensors cannot enter a captured graph; calls outside them run on the graphs"
    )


@functools.cache
def _warn_once_generator_input(where: str) -> None:
    logger.warning(
        "ORTModule runs the calls that pass a torch.Generator (%s) in PyTorch, which draws from it "
        "as eager does: a captured graph cannot take one; calls without one run on the graphs",
        where,
    )


@functools.cache
def _warn_once_under_forward_ad() -> None:
    logger.warning(
        "ORTModule runs the model in PyTorch for calls with forward-mode AD tangents "
        "(torch.autograd.forward_ad dual tensors): a captured graph computes no tangents; calls "
        "without them run on the graphs"
    )


def _describe_input_change(before: Spec, after: Spec) -> str:
    old, new = call_leaves(before), call_leaves(after)
    if [p for p, _ in old] != [p for p, _ in new]:
        return "the structure of the inputs changed"
    for (place, a), (_, b) in zip(old, new, strict=True):
        if a != b:
            if a[0] == "const" and b[0] == "const":
                return f"{place} changed from {a[2]!r} to {b[2]!r}"
            if a[0] == "const" and a[1] in (float, int) and b[0] == "tensor":
                # The number was lifted (ortmodule/scalars.py): say so, not "to a tensor".
                return f"{place} changed from {a[2]!r}; it is an input of the graph from now on"
            return f"{place} changed from {_show_leaf(a)} to {_show_leaf(b)}"
    return "the structure of the inputs changed"


def _show_leaf(leaf: Spec) -> str:
    return "a tensor" if leaf[0] == "tensor" else repr(leaf[2])


def _show_signature(signature: tuple[Any, ...]) -> str:
    dtype, rank, device, requires_grad, layout, *attributes = signature
    grad = ", requires_grad" if requires_grad else ""
    carried = f", with {dict(attributes[0])}" if attributes else ""
    return f"{str(dtype).removeprefix('torch.')} of rank {rank} on {device}{grad}, {layout}{carried}"
