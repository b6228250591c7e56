"""``ORTModule``: wrap an ``nn.Module`` so that its forward and backward run on ONNX Runtime."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ortrain.capture.aot_capture import Capture, GraphSlot, capture
from ortrain.capture.huggingface import register_hf_cache_types
from ortrain.ortmodule._custom_autograd_function import custom_autograd_enabled
from ortrain.ortmodule.fallback import (
    FallbackManager,
    ORTModuleDeviceException,
    ORTModuleFallbackException,
    ORTModuleIOError,
    ORTModuleONNXModelException,
    ORTModuleTorchModelException,
)
from ortrain.ortmodule.options import DebugOptions, python_log_level, runtime_options
from ortrain.ortmodule.schema import Spec, flatten_inputs, flatten_outputs, tensor_signature, unflatten
from ortrain.passes.pipeline import StageSaver, default_passes
from ortrain.runtime.graph_executor import build_graph_executor
from ortrain.runtime.memory import release_freed_memory

logger = logging.getLogger("ortrain.ortmodule")

# Names ORTModule keeps for itself; every other attribute lives on the wrapped module.
_OWN_ATTRIBUTES = frozenset(
    {
        "_ortrain_module",
        "_ortrain_debug",
        "_ortrain_options",
        "_ortrain_graphs",
        "_ortrain_fallback",
        "_ortrain_state",
        "training",
    }
)


class _FlatCall(nn.Module):
    """The wrapped module seen as a function of flat tensors returning a tuple of tensors."""

    def __init__(self, module: nn.Module, input_spec: Spec) -> None:
        super().__init__()
        self.module = module
        self.input_spec = input_spec
        self.output_spec: Spec | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = unflatten(self.input_spec, list(tensors))
        out = self.module(*args, **kwargs)
        flat, self.output_spec = flatten_outputs(out)
        return tuple(flat)


@dataclass
class _CompiledEntry:
    capture: Capture
    sizes: list[tuple[int | None, ...]]  # per input: fixed size, or None where dynamic
    output_spec: Spec

    def matches(self, inputs: list[torch.Tensor]) -> bool:
        for tensor, pattern in zip(inputs, self.sizes, strict=True):
            for size, fixed in zip(tensor.shape, pattern, strict=True):
                if fixed is not None and size != fixed:
                    return False
        return True


class ORTModule(nn.Module):
    """Train ``module`` on ONNX Runtime.

    Parameters, buffers and ``state_dict`` keys are the wrapped module's own, so optimizers,
    checkpoints and wrappers such as DistributedDataParallel see the model they expect.
    """

    def __init__(self, module: nn.Module, debug_options: DebugOptions | None = None) -> None:
        if isinstance(module, nn.DataParallel):
            raise TypeError(
                "ORTModule does not support torch.nn.DataParallel; "
                "use torch.nn.parallel.DistributedDataParallel instead (wrap the ORTModule with it)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, not {type(module).__name__}")
        super().__init__()
        debug = debug_options or DebugOptions()
        options = runtime_options()
        object.__setattr__(self, "_ortrain_module", module)
        object.__setattr__(self, "_ortrain_debug", debug)
        object.__setattr__(self, "_ortrain_options", options)
        object.__setattr__(self, "_ortrain_graphs", {})
        object.__setattr__(self, "_ortrain_fallback", FallbackManager(options.fallback_policy))
        object.__setattr__(self, "_ortrain_state", None)
        logging.getLogger("ortrain").setLevel(python_log_level(debug.log_level))
        register_hf_cache_types()
        self.training = module.training

    # ---- the wrapped module's own objects --------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._ortrain_module

    def __getattr__(self, name: str) -> Any:
        if name in _OWN_ATTRIBUTES:
            return object.__getattribute__(self, name)
        return getattr(self._ortrain_module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
            return
        setattr(self._ortrain_module, name, value)
        # The model changed under us: whatever was captured may no longer describe it.
        self._invalidate()

    def __delattr__(self, name: str) -> None:
        delattr(self._ortrain_module, name)
        self._invalidate()

    def _invalidate(self) -> None:
        self._ortrain_graphs.clear()
        object.__setattr__(self, "_ortrain_state", None)

    # Registering goes to the wrapped module too: on the wrapper, the new state would be invisible
    # to the model's forward and to its state_dict.
    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        self._ortrain_module.register_buffer(name, tensor, persistent)
        self._invalidate()

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        self._ortrain_module.register_parameter(name, param)
        self._invalidate()

    def add_module(self, name: str, module: nn.Module | None) -> None:
        self._ortrain_module.add_module(name, module)
        self._invalidate()

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

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        result = self._ortrain_module.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            object.__setattr__(self, "_ortrain_state", None)
        return result

    def train(self, mode: bool = True) -> ORTModule:
        self._ortrain_module.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ORTModule:  # type: ignore[override]
        self._ortrain_module._apply(fn, recurse)
        object.__setattr__(self, "_ortrain_state", None)
        return self

    def extra_repr(self) -> str:
        return f"module={type(self._ortrain_module).__name__}"

    def __repr__(self) -> str:
        return f"ORTModule({self._ortrain_module!r})"

    # ---- running -------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fallback: FallbackManager = self._ortrain_fallback
        if fallback.active:
            return self._ortrain_module(*args, **kwargs)
        try:
            return self._run_on_ort(args, kwargs)
        except ORTModuleFallbackException as error:
            fallback.handle(error)
            return self._ortrain_module(*args, **kwargs)

    def _state_by_name(self) -> dict[str, torch.Tensor]:
        state = self._ortrain_state
        if state is None:
            module = self._ortrain_module
            state = {f"module.{n}": p for n, p in module.named_parameters(remove_duplicate=False)}
            state.update({f"module.{n}": b for n, b in module.named_buffers(remove_duplicate=False)})
            object.__setattr__(self, "_ortrain_state", state)
        return state

    def _run_on_ort(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inputs, spec = flatten_inputs(args, kwargs)
        state = self._state_by_name()
        for tensor in (*inputs, *state.values()):
            if tensor.device.type != "cpu":
                raise ORTModuleDeviceException(
                    f"ortrain runs on the CPU execution provider; got a tensor on {tensor.device}"
                )
        training = self.training and torch.is_grad_enabled()
        opaque = custom_autograd_enabled(self._ortrain_options.enable_custom_autograd)
        signature = tuple(tensor_signature(t) for t in inputs)
        key = (spec, signature, self.training, torch.is_grad_enabled(), opaque)
        entries: list[_CompiledEntry] = self._ortrain_graphs.setdefault(key, [])
        entry = next((e for e in entries if e.matches(inputs)), None)
        # A failure may be the user's (a wrong shape or dtype, or two sizes a dynamic graph saw
        # equal that now differ): then PyTorch's own error is the one to show. Only when eager
        # PyTorch accepts the inputs is it ortrain's failure, for the fallback policy to judge.
        if entry is None:
            try:
                entry = self._compile(spec, inputs, entries, training=training, opaque=opaque)
            except Exception:
                self._raise_if_user_error(spec, inputs)
                raise
            entries.append(entry)
        state_tensors = [state[name] for name in entry.capture.state_names]
        try:
            outputs = entry.capture(state_tensors, inputs)
        except Exception as error:
            self._raise_if_user_error(spec, inputs)
            raise ORTModuleONNXModelException(
                f"ONNX Runtime failed to run the forward graph: {type(error).__name__}: {error}"
            ) from error
        return unflatten(entry.output_spec, list(outputs))

    def _dynamic_dims(
        self, inputs: list[torch.Tensor], entries: list[_CompiledEntry]
    ) -> dict[int, tuple[int, ...]]:
        """Sizes that differ from an earlier capture, or were dynamic in one, become dynamic."""
        dims: dict[int, set[int]] = {}
        for entry in entries:
            for i, (tensor, pattern) in enumerate(zip(inputs, entry.sizes, strict=True)):
                for d, (size, fixed) in enumerate(zip(tensor.shape, pattern, strict=True)):
                    if fixed is None or fixed != size:
                        dims.setdefault(i, set()).add(d)
        return {i: tuple(sorted(d)) for i, d in dims.items()}

    def _compile(
        self,
        spec: Spec,
        inputs: list[torch.Tensor],
        entries: list[_CompiledEntry],
        *,
        training: bool,
        opaque: bool,
    ) -> _CompiledEntry:
        flat_module = _FlatCall(self._ortrain_module, spec)
        dynamic = self._dynamic_dims(inputs, entries)
        logger.info(
            "capturing %s graphs for %d inputs%s",
            "training" if training else "inference",
            len(inputs),
            f" with dynamic sizes {dynamic}" if dynamic else "",
        )
        try:
            captured = capture(
                flat_module,
                inputs,
                training=training,
                dynamic_dims=dynamic,
                opaque_functions=opaque,
                checkpoint_ops=self._ortrain_options.allow_autograd_checkpoint,
            )
        except ORTModuleIOError:
            raise  # an output ortrain cannot pass back: FALLBACK_UNSUPPORTED_DATA decides, not TORCH_MODEL
        except Exception as error:
            raise ORTModuleTorchModelException(f"capture failed: {type(error).__name__}: {error}") from error
        if flat_module.output_spec is None:
            raise ORTModuleTorchModelException("capture did not run the model's forward")
        saver = None
        debug: DebugOptions = self._ortrain_debug
        if debug.save_onnx:
            saver = StageSaver(debug.save_path, debug.onnx_prefix, "training" if training else "inference")
        passes = default_passes(compute_optimizer=self._ortrain_options.enable_compute_optimizer)
        slots: list[tuple[str, GraphSlot]] = [("forward", captured.forward)]
        if captured.backward is not None:
            slots.append(("backward", captured.backward))
        device = inputs[0].device if inputs else torch.device("cpu")
        for name, slot in slots:
            slot.runner = build_graph_executor(
                slot.graph,
                name=name,
                opset_version=self._ortrain_options.opset_version,
                passes=passes,
                saver=saver,
                device=device,
            )
        # Export keeps example tensors alive until collected; give their memory back now.
        gc.collect()
        release_freed_memory()
        first = len(captured.state_names)
        fw_values = captured.forward.placeholder_values[first:]
        sizes = [tuple(s if isinstance(s, int) else None for s in value.shape) for value in fw_values]
        return _CompiledEntry(captured, sizes, flat_module.output_spec)

    def _raise_if_user_error(self, spec: Spec, inputs: list[torch.Tensor]) -> None:
        """If eager PyTorch rejects these inputs too, raise PyTorch's own error: the user's to fix.

        The check runs in eval mode without gradients so that it updates no running statistics.
        """
        module = self._ortrain_module
        args, kwargs = unflatten(spec, inputs)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                module(*args, **kwargs)
        finally:
            module.train(was_training)
