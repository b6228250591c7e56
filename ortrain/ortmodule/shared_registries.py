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
see it at the next step as any change to the model. The tables are read from the model at each
access (``ModelTable``), so a model that rebinds one is followed too.

One write stays refused: ``torch.nn.utils.parametrize`` on a tensor of the model's root, through
the wrapper, moves the tensor out of the model and puts the property that computes it on the
wrapper's class, where the model's forward never reads it: it is refused before anything moved.
"""

from __future__ import annotations

from collections import OrderedDict
from types import FrameType
from typing import Any

from torch import nn


class ModelTable:
    """A class attribute of the wrapper: its ``name`` table is the wrapped model's, read live (the
    model may rebind it: ``model._modules = OrderedDict(...)`` left a shared copy stale, and a
    parent's ``load_state_dict`` walked the old submodules, wave 46's review). Until the model is
    set (``nn.Module.__init__`` makes the wrapper's own), the wrapper's own; set afterwards, the
    model's."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, wrapper: nn.Module | None, owner: type | None = None) -> Any:
        if wrapper is None:
            return self
        model = wrapper.__dict__.get("_ortrain_module")
        return wrapper.__dict__[self.name] if model is None else model.__dict__[self.name]

    def __set__(self, wrapper: nn.Module, value: Any) -> None:
        model = wrapper.__dict__.get("_ortrain_module")
        if model is None:
            wrapper.__dict__[self.name] = value
        else:
            setattr(model, self.name, value)


class ModelPostHooks:
    """The wrapper's load-state-dict post hooks: one that runs the model's own, with the model as
    their module. A parent's ``load_state_dict`` walks the wrapper's tables (the model's
    submodules) and runs the wrapper's post hooks after them; those registered through the
    wrapper are the model's, and a hook that checks its module's class must meet the model."""

    def __get__(self, wrapper: nn.Module | None, owner: type | None = None) -> Any:
        if wrapper is None:
            return self
        model = wrapper.__dict__.get("_ortrain_module")
        if model is None:
            return wrapper.__dict__["_load_state_dict_post_hooks"]

        def run_the_models(module: nn.Module, incompatible_keys: Any) -> None:
            for hook in model._load_state_dict_post_hooks.values():
                if hook(model, incompatible_keys) is not None:
                    raise RuntimeError("load_state_dict post hooks should modify incompatible_keys in place")

        return OrderedDict({0: run_the_models})

    def __set__(self, wrapper: nn.Module, value: Any) -> None:
        wrapper.__dict__["_load_state_dict_post_hooks"] = value


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
