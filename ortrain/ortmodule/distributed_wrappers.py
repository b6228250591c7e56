"""Data-parallel wrappers in the wrong place, and sharded models: refused by name.

ORTModule goes inside the data-parallel wrapper, ``DistributedDataParallel(ORTModule(model))``,
where DDP's forward runs at every step and prepares the gradient all-reduce. Inside the
ORTModule it does not: the captured graph replaces every forward it holds, DDP's included, so each
rank trained on its own gradients and the ranks drifted apart, silently (wave 28: parameters 3e-2
apart after four steps on two ranks).

FSDP2 (``fully_shard``) keeps each parameter as a sharded ``DTensor``, all-gathers a module's
parameters in hooks around that module's forward and reduce-scatters their gradients in hooks on
its backward: hooks the captured graph cannot run. Traced, they met fake tensors ("Please convert
all Tensors to FakeTensors"); on the wrapper, FSDP found a module tree that does not name the
wrapper and failed in its own start-up. Neither said what to do.

So:

- ``ORTModule(DistributedDataParallel(m))`` and ``ORTModule(nn.DataParallel(m))`` raise
  ``TypeError`` at once;
- ``fully_shard(ORTModule(model))`` raises ``TypeError`` when FSDP gives the wrapper its class;
- a model holding a ``DistributedDataParallel`` submodule, or ``DTensor`` parameters
  (``fully_shard`` or tensor parallelism, applied before or after wrapping), raises
  ``ORTModuleTorchModelException`` when it would be captured: under the default fallback policy
  the model then trains in PyTorch, where these wrappers' forwards and hooks run as written, after
  one warning.

``DistributedDataParallel`` around the ORTModule and DeepSpeed ZeRO (stages 1-3) are the supported
ways to train on several ranks.
"""

from __future__ import annotations

import sys

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ortrain.errors import ORTModuleTorchModelException

ADVICE = (
    "wrap the ORTModule with DistributedDataParallel, or shard it with DeepSpeed ZeRO (stages 1-3), "
    "which ORTModule supports"
)
_DDP_OUTSIDE = (
    "wrap the model with ORTModule first and DistributedDataParallel around it: "
    "DistributedDataParallel(ORTModule(model))"
)


def refuse_data_parallel_inside(module: nn.Module) -> None:
    """Raise when the module ORTModule is given is a data-parallel wrapper."""
    if isinstance(module, nn.DataParallel):
        raise TypeError(
            "ORTModule does not support torch.nn.DataParallel; "
            "use torch.nn.parallel.DistributedDataParallel instead (wrap the ORTModule with it)"
        )
    if isinstance(module, DistributedDataParallel):
        raise TypeError(
            "ORTModule cannot wrap DistributedDataParallel: the captured graph would replace DDP's "
            "forward, which prepares the gradient all-reduce, and each rank would train alone; "
            f"{_DDP_OUTSIDE}"
        )


def refuse_fsdp_wrapper_class(new_class: type) -> None:
    """Raise when ``fully_shard`` turns an ORTModule into an FSDP module."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported here: no FSDP, no check
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is not None and issubclass(new_class, fsdp_module):
        raise TypeError(f"ORTModule cannot be sharded with FSDP (fully_shard): {ADVICE}")


def refuse_distributed_submodules(module: nn.Module) -> None:
    """Raise when ``module`` holds a DDP submodule or ``DTensor`` parameters (FSDP2, tensor
    parallelism): the captured graph would skip their forwards and hooks."""
    for name, sub in module.named_modules():
        if isinstance(sub, DistributedDataParallel):
            raise ORTModuleTorchModelException(
                f"submodule {name!r} is a DistributedDataParallel, whose forward the captured graph "
                f"would skip (no gradient all-reduce): {_DDP_OUTSIDE}"
            )
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return
    for name, param in module.named_parameters():
        if isinstance(param, dtensor):
            raise ORTModuleTorchModelException(
                f"parameter {name!r} is a DTensor (sharded by FSDP's fully_shard or by tensor "
                f"parallelism), whose hooks ORTModule's captured graph cannot run: {ADVICE}"
            )
