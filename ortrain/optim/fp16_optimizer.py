"""FP16_Optimizer: make an existing mixed-precision optimizer cheaper, or make a plain one mixed-precision.

``FP16_Optimizer(optimizer, **kwargs)`` looks at the optimizer's fully qualified class name:

* DeepSpeed ZeRO stage 1/2 (``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer``): its
  overflow checks and gradient norm become multi-tensor (:mod:`ortrain.optim._deepspeed_zero`); the same
  object is returned.
* An optimizer processed by ``apex.amp.initialize`` (apex keeps the class and adds ``_amp_stash``): its
  gradient unscaling and overflow check become multi-tensor (:mod:`ortrain.optim._apex_amp`); the same
  object is returned.
* Any other ``torch.optim.Optimizer``: a
  :class:`~ortrain.optim.mixed_precision.MixedPrecisionOptimizer` around it (fp32 master weights of its
  fp16/bf16 parameters, dynamic loss scaling), built with ``kwargs``; one already wrapped comes back.
* Anything else is returned unchanged, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ortrain.optim._apex_amp import is_amp_optimizer, patch_amp_optimizer
from ortrain.optim._deepspeed_zero import DEEPSPEED_ZERO_CLASSES, patch_deepspeed_zero_optimizer
from ortrain.optim.mixed_precision import LOW_PRECISION_DTYPES, MixedPrecisionOptimizer

logger = logging.getLogger("ortrain.optim.fp16_optimizer")

__all__ = ["FP16_Optimizer", "qualified_class_name"]


def qualified_class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def FP16_Optimizer(optimizer: Any, **kwargs: Any) -> Any:
    """Returns ``optimizer`` patched in place (DeepSpeed ZeRO, apex amp) or a mixed-precision wrapper.

    ``kwargs`` go to :class:`MixedPrecisionOptimizer` (``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``dynamic_loss_scale``, ``min_scale``, ``max_scale``); the
    patched DeepSpeed/apex optimizers keep their own loss-scaling settings and take none.
    """
    name = qualified_class_name(optimizer)
    if name in DEEPSPEED_ZERO_CLASSES:
        _no_kwargs(name, kwargs)
        patch_deepspeed_zero_optimizer(optimizer)
        return optimizer
    if is_amp_optimizer(optimizer):
        _no_kwargs(name, kwargs)
        patch_amp_optimizer(optimizer)
        return optimizer
    if isinstance(optimizer, MixedPrecisionOptimizer):
        logger.warning("FP16_Optimizer: %s is already a mixed-precision wrapper; returned unchanged", name)
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        dtypes = {p.dtype for g in optimizer.param_groups for p in g["params"]}
        if not dtypes & set(LOW_PRECISION_DTYPES):
            # A float32 model under float16 autocast needs the loss scaling all the same; and the
            # loop it is written for calls ``optimizer.backward(loss)``, which a bare torch
            # optimizer lacks (until wave 45 it came back unchanged, and that call failed).
            logger.info(
                "FP16_Optimizer: %s has no fp16/bf16 parameters: they are their own masters, "
                "and the wrapper scales the loss and skips overflowing steps",
                name,
            )
        return MixedPrecisionOptimizer(optimizer, **kwargs)
    logger.warning("FP16_Optimizer: %s is not a supported optimizer; returned unchanged", name)
    return optimizer


def _no_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"FP16_Optimizer takes no options for {name}, got {sorted(kwargs)}")
