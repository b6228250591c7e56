"""Multi-tensor overflow check and gradient norm for DeepSpeed's ZeRO stage 1/2 optimizer.

``DeepSpeedZeroOptimizer`` (``deepspeed.runtime.zero.stage_1_and_2``) checks overflow and computes the
gradient norm one gradient at a time: a few kernels per gradient, and in releases before ~0.10 a host
synchronisation per gradient too. This replaces, on the given instance only, ``has_overflow_serial``,
``has_overflow_partitioned_grads_serial`` and ``get_grad_norm_direct`` with versions that do the per-tensor
work in one ``torch._foreach_norm`` per dtype, keeping DeepSpeed's semantics (padding and
pipeline-replicated gradients skipped, model-parallel ranks, all-reduces, the -1 sentinel for a
non-finite norm).

Written against DeepSpeed 0.19.8; each method is patched only if the instance has it with the expected
parameters, so a release that renamed one keeps its own version.
"""

from __future__ import annotations

import inspect
import logging
import math
import types
from typing import Any

import torch
from torch import Tensor

from ortrain.optim._multi_tensor_checks import nonfinite_flag

logger = logging.getLogger("ortrain.optim.deepspeed_zero")

# Fully qualified class names handled here (the legacy module name is DeepSpeed < 0.6).
DEEPSPEED_ZERO_CLASSES = (
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "deepspeed.runtime.zero.stage2.FP16_DeepSpeedZeroOptimizer",
)

# method name -> the parameter names (after self) it must have for our replacement to be a drop-in.
_EXPECTED_SIGNATURES = {
    "has_overflow_serial": ["params"],
    "has_overflow_partitioned_grads_serial": [],
    "get_grad_norm_direct": ["gradients", "params", "norm_type"],
}


def _accelerator_device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def has_overflow_serial(self: Any, params: Any) -> Tensor:
    """Whether any ``p.grad`` is non-finite, as DeepSpeed's: a bool tensor of shape [1] on the device."""
    return nonfinite_flag([p.grad for p in params], device=_accelerator_device()).reshape(1)


def has_overflow_partitioned_grads_serial(self: Any) -> Tensor:
    """Whether any gradient of this rank's partitions is non-finite (bool tensor of shape [1])."""
    grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
    return nonfinite_flag(grads, device=_accelerator_device()).reshape(1)


def get_grad_norm_direct(self: Any, gradients: Any, params: Any, norm_type: float = 2) -> Tensor:
    """Total ``norm_type``-norm of ``gradients`` across data/model-parallel ranks, as DeepSpeed's."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    try:
        from deepspeed.runtime.zero.utils import get_norm_dtype

        norm_dtype = get_norm_dtype()
    except ImportError:  # releases before get_norm_dtype accumulated in fp64
        norm_dtype = torch.float64
    device = _accelerator_device()
    norm_type = float(norm_type)
    if norm_type == math.inf:
        grads = [g.data for g in gradients if g.numel() > 0]
        if grads:
            total_norm = torch.stack(torch._foreach_norm(grads, math.inf)).float().max().to(device)
        else:
            total_norm = torch.zeros((), dtype=torch.float32, device=device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.MAX)
    else:
        # Same selection as DeepSpeed: padding dropped before pairing with params (sic), replicated
        # pipeline parameters counted once, non-model-parallel parameters only on model-parallel rank 0.
        param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
        selected = [
            g.data
            for g, p in zip(param_gradients, params, strict=False)
            if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
            and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
        ]
        if selected:
            norms = torch.stack(torch._foreach_norm(selected, norm_type, dtype=norm_dtype))
            total_norm = norms.to(device).pow(norm_type).sum().float()
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
        total_norm = total_norm.pow(1.0 / norm_type)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


_REPLACEMENTS = {
    "has_overflow_serial": has_overflow_serial,
    "has_overflow_partitioned_grads_serial": has_overflow_partitioned_grads_serial,
    "get_grad_norm_direct": get_grad_norm_direct,
}


def patch_deepspeed_zero_optimizer(optimizer: Any) -> list[str]:
    """Bind the multi-tensor methods onto ``optimizer``; returns the names patched."""
    patched: list[str] = []
    for name, replacement in _REPLACEMENTS.items():
        original = getattr(type(optimizer), name, None)
        if original is None:
            logger.warning("%s has no %s; left as is", type(optimizer).__qualname__, name)
            continue
        params = list(inspect.signature(original).parameters)[1:]
        if params != _EXPECTED_SIGNATURES[name]:
            logger.warning(
                "%s.%s takes %s, expected %s; left as is",
                type(optimizer).__qualname__,
                name,
                params,
                _EXPECTED_SIGNATURES[name],
            )
            continue
        setattr(optimizer, name, types.MethodType(replacement, optimizer))
        patched.append(name)
    logger.info("DeepSpeed ZeRO optimizer: multi-tensor %s", ", ".join(patched) or "nothing")
    return patched
