"""A forward that assigns a tensor to a plain attribute: ``self.aux_loss = ...`` (a mixture-of-experts
gate's balancing loss, which the training loop adds to the model's), ``self.last = h.detach()``
(feature logging), pruning's ``weight`` (recomputed by its pre-hook before each forward).

Eager PyTorch leaves the new tensor in the module after each call, with its autograd graph.
During a capture a plain tensor attribute is a buffer (:mod:`ortrain.capture.tensor_attributes`),
and the assignment used to be either lost (one that requires grad: the balancing loss kept the
tensor of the step that ran in PyTorch, and the next backward through it failed, "Trying to
backward through the graph a second time"; wave 29) or copied in place into the old tensor, which
refused a new shape (the last, smaller batch's activation) and made the attribute the same tensor
at every step (a list of each step's activations held the last one, repeated).

So each plain attribute the forward assigns becomes an extra output of the captured forward, set
on its module after every run (:func:`assign_attributes`): the tensor eager PyTorch would hold, a
new one at every step, differentiable through the graph. Registered buffers keep their in-place
update (:mod:`ortrain.capture.buffer_assignments`), and so does an attribute that views a parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ortrain.capture.buffer_assignments import Buffers
from ortrain.capture.tensor_attributes import is_attribute_buffer, is_parameter_view


@dataclass(frozen=True)
class AssignedAttributes:
    """How a forward that assigns attributes returns: the flat outputs of its value (``value_spec``)
    followed by one tensor per assigned attribute that holds a tensor (``paths``, dotted from the
    wrapped model; ``holds_tensor`` False: the forward set it to ``None``)."""

    value_spec: Any
    paths: tuple[str, ...]
    holds_tensor: tuple[bool, ...]

    @property
    def extra_outputs(self) -> int:
        return sum(self.holds_tensor)


def take_attribute_assignments(
    root: nn.Module, before: Buffers
) -> tuple[list[tuple[str, torch.Tensor | None]], Buffers]:
    """After the traced forward: the plain attributes it assigned, as (path, new value), each put
    back to the value it had; and the rest of ``before`` (registered buffers and untouched
    attributes), for :func:`ortrain.capture.buffer_assignments.keep_assignments_as_updates`."""
    assigned: list[tuple[nn.Module, str, torch.Tensor | None]] = []
    rest: Buffers = []
    for module, name, old in before:
        new = module._buffers.get(name)
        # One that views a parameter (spectral_norm's ``weight`` before its first forward) stays
        # as it was, as buffer_assignments leaves it: an output would change its requires-grad
        # after the first run, and with it the graph's key (a second capture for nothing).
        if new is not old and is_attribute_buffer(module, name) and not is_parameter_view(module, name):
            assigned.append((module, name, new))
            module._buffers[name] = old
        else:
            rest.append((module, name, old))
    if not assigned:
        return [], rest
    paths: dict[int, str] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    return [(_dotted(paths[id(module)], name), new) for module, name, new in assigned], rest


def _dotted(module_path: str, name: str) -> str:
    return f"{module_path}.{name}" if module_path else name


def with_assigned_attributes(
    flat: list[torch.Tensor], value_spec: Any, assigned: list[tuple[str, torch.Tensor | None]]
) -> tuple[list[torch.Tensor], Any]:
    """The forward's flat outputs and spec, with the assigned attributes' tensors appended."""
    if not assigned:
        return flat, value_spec
    spec = AssignedAttributes(
        value_spec,
        tuple(path for path, _ in assigned),
        tuple(isinstance(value, torch.Tensor) for _, value in assigned),
    )
    return [*flat, *(value for _, value in assigned if isinstance(value, torch.Tensor))], spec


def assign_attributes(root: nn.Module, spec: AssignedAttributes, tensors: Sequence[Any]) -> None:
    """Set each assigned attribute on its module, as the forward did in eager PyTorch."""
    values = iter(tensors)
    for path, holds_tensor in zip(spec.paths, spec.holds_tensor, strict=True):
        prefix, _, name = path.rpartition(".")
        setattr(root.get_submodule(prefix), name, next(values) if holds_tensor else None)
