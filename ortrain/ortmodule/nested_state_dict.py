"""Loading a state dict into a model that holds an ORTModule as a submodule.

The wrapper keeps the wrapped model out of its own ``_modules`` (its names are the model's, with
no ``module.`` prefix, and it forwards ``state_dict``, ``named_parameters`` and the like). A
parent's ``load_state_dict`` walks ``_modules`` and calls each module's ``_load_from_state_dict``:
it reached the wrapper, found no parameters and no children, and reported every key of the wrapped
model as unexpected (``strict=False`` loaded nothing, silently). The wrapper's
``_load_from_state_dict`` therefore walks the wrapped model as the parent's walk would have.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import nn


class IncompatibleKeys(NamedTuple):
    """What a load-state-dict post hook receives (the fields of PyTorch's own, edited in place)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_wrapped_model(
    model: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """What ``nn.Module.load_state_dict``'s recursive walk does for ``model`` and its submodules."""
    assign = local_metadata.get("assign_to_params_buffers", False)

    def load(module: nn.Module, entries: dict[str, Any], prefix: str, metadata: dict[str, Any]) -> None:
        module._load_from_state_dict(
            entries, prefix, metadata, True, missing_keys, unexpected_keys, error_msgs
        )
        for name, child in module._modules.items():
            if child is None:
                continue
            child_prefix = f"{prefix}{name}."
            child_entries = {k: v for k, v in entries.items() if k.startswith(child_prefix)}
            load(child, child_entries, child_prefix, {"assign_to_params_buffers": assign} if assign else {})
        incompatible = IncompatibleKeys(missing_keys, unexpected_keys)
        for hook in module._load_state_dict_post_hooks.values():
            if hook(module, incompatible) is not None:
                raise RuntimeError("load_state_dict post hooks should modify incompatible_keys in place")

    load(model, state_dict, prefix, local_metadata)
