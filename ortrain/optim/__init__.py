"""Optimizers: multi-tensor FusedAdam and the FP16_Optimizer mixed-precision helper."""

from ortrain.optim.fp16_optimizer import FP16_Optimizer
from ortrain.optim.fused_adam import AdamWMode, FusedAdam

__all__ = ["AdamWMode", "FP16_Optimizer", "FusedAdam"]
