"""The wrapper's parameter, buffer and submodule tables are the wrapped module's own.

``nn.Module.__init__`` gives the wrapper empty tables of its own. ORTModule's methods reach the
model (``register_parameter``, ``add_module``, ``named_children``, ``__getattr__``, ...), but code
that writes the tables directly wrote into the wrapper's, where the model's forward never looks
(wave 46's review): ``torch.ao.quantization.prepare_qat(wrapped)`` swaps modules with
``module._modules[name] = qat_module``, and the wrapped model trained without weight fake-quant,
silently (a loss 4e-3 off eager's); ``prune.l1_unstructured(wrapped, "weight")`` and
``weight_norm(wrapped)`` on a root parameter (``del module._parameters[name]``) raised
``KeyError`` half-way, leaving a stray ``weight_orig`` in the model's ``state_dict``. Shared,
the tables hold the model's entries, and a write lands where the forward reads it; the guards
see it at the next step as any change to the model.

One write stays refused: ``torch.nn.utils.parametrize`` on a tensor of the model's root, through
the wrapper, moves the tensor out of the model and puts the property that computes it on the
wrapper's class, where the model's forward never reads it: it is refused before anything moved.
"""

from __future__ import annotations

from types import FrameType

from torch import nn

# And the load-state-dict post hooks: a parent's ``load_state_dict`` walks these tables and runs
# each module's post hooks after its submodules (those registered through the wrapper are the
# model's); until wave 46 the wrapper loaded its model by a walk of its own (nested_state_dict.py).
_TABLES = (
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_load_state_dict_post_hooks",
)


def share_registries(wrapper: nn.Module, module: nn.Module) -> None:
    """Make ``wrapper``'s tables the very objects ``module`` holds."""
    for name in _TABLES:
        object.__setattr__(wrapper, name, module.__dict__[name])


def refuse_root_parametrization(module: nn.Module, name: str, caller: FrameType | None) -> None:
    """Raise when ``torch.nn.utils.parametrize`` deletes one of the model's own tensors through
    the wrapper (its first step towards a property on the wrapper's class)."""
    if caller is None or caller.f_globals.get("__name__") != "torch.nn.utils.parametrize":
        return
    if name in module._parameters or name in module._buffers:
        raise TypeError(
            f"torch.nn.utils.parametrize on the wrapped model's own {name!r} through ORTModule: the "
            "parametrization would live on the wrapper's class, where the model's forward never reads "
            f"it. Register it on the model itself, register_parametrization(wrapped.module, {name!r}, "
            "...) (as weight_norm, spectral_norm and orthogonal from torch.nn.utils.parametrizations): "
            "ORTModule sees the change at the next step"
        )
