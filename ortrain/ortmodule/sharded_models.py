"""Models sharded by FSDP2 (``fully_shard``) or by tensor parallelism: refused by name.

FSDP2 keeps each parameter as a sharded ``DTensor``, all-gathers a module's parameters in hooks
around that module's forward and reduce-scatters their gradients in hooks on its backward.
ORTModule runs one captured graph in place of the submodules: the hooks would run inside the trace,
on fake tensors ("Please convert all Tensors to FakeTensors"), or, on the wrapper, find a module
tree that does not name the wrapper and fail in FSDP's own start-up ("'FSDPCommContext' object has
no attribute 'all_gather_state'"). Neither said what to do, so both are refused:

- ``fully_shard(ORTModule(model))`` raises ``TypeError`` when FSDP gives the wrapper its class;
- an ORTModule over a model whose parameters are ``DTensor``\\ s (``fully_shard`` or
  ``parallelize_module`` applied before or after wrapping) raises
  ``ORTModuleTorchModelException`` when it would capture: under the default fallback policy the
  model then trains in PyTorch, where FSDP's hooks run as written, after one warning.

DistributedDataParallel around the ORTModule and DeepSpeed ZeRO (stages 1-3) are the supported
ways to train it on several ranks.
"""

from __future__ import annotations

import sys

from torch import nn

from ortrain.errors import ORTModuleTorchModelException

ADVICE = (
    "wrap the ORTModule with DistributedDataParallel, or shard it with DeepSpeed ZeRO (stages 1-3), "
    "which ORTModule supports"
)


def refuse_fsdp_wrapper_class(new_class: type) -> None:
    """Raise when ``fully_shard`` turns an ORTModule into an FSDP module."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported here: no FSDP, no check
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is not None and issubclass(new_class, fsdp_module):
        raise TypeError(f"ORTModule cannot be sharded with FSDP (fully_shard): {ADVICE}")


def refuse_sharded_parameters(module: nn.Module) -> None:
    """Raise when a parameter of ``module`` is a ``DTensor`` (FSDP2, tensor parallelism)."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(dtensor_module, "DTensor", None)
    if dtensor is None:
        return
    for name, param in module.named_parameters():
        if isinstance(param, dtensor):
            raise ORTModuleTorchModelException(
                f"parameter {name!r} is a DTensor (sharded by FSDP's fully_shard or by tensor "
                f"parallelism), whose hooks ORTModule's captured graph cannot run: {ADVICE}"
            )
