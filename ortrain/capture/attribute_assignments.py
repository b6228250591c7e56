"""A forward that assigns a tensor to a buffer or a plain attribute: ``self.ema = self.ema * 0.9 +
0.1 * x`` (a moving average, a VQ codebook), ``self.h = h.detach()`` (an RNN's state carried to the
next batch), ``self.aux_loss = ...`` (a mixture-of-experts gate's balancing loss, which the training
loop adds to the model's), ``self.last = h.detach()`` (feature logging), pruning's ``weight``
(recomputed by its pre-hook before each forward).

Eager PyTorch leaves the new tensor in the module after each call, with its autograd graph; the
tensor it replaced is untouched. A capture traces the forward with the buffers swapped for graph
inputs (a plain tensor attribute is a buffer then: :mod:`ortrain.capture.tensor_attributes`), and
the assignment landed in the swapped-in dictionary and was lost: the average never moved (until
wave 28), a loss kept on the module held the tensor of the step that ran in PyTorch (wave 29).

So each buffer or attribute the forward assigns becomes an extra output of the captured forward,
set on its module after every run (:func:`assign_attributes`): the tensor eager PyTorch would
hold, a new one at every step, differentiable through the graph, of any shape. Until wave 50 a
registered buffer was instead copied into the tensor it replaced, in place: that refused a new
shape (a buffer that grows), and where the forward had read the old value for the backward
(``rnn(x, self.h)`` then ``self.h = h.detach()``), the copy overwrote what the backward needed
("modified by an inplace operation"). An attribute that views a parameter (the hook form of
spectral_norm's ``weight``, ``weight_orig.data`` until its pre-hook assigns the normalized weight)
was left as it was until wave 50, and the module held the raw weight for good: it is an output
like the others, at the cost of one more capture (its requires-grad flag changes after the first
run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Buffers = list[tuple[nn.Module, str, torch.Tensor]]


def buffers_before(root: nn.Module) -> Buffers:
    """Every buffer of ``root`` and its submodules, with its owner and name, before the forward."""
    return [
        (module, name, tensor)
        for module in root.modules()
        for name, tensor in module._buffers.items()
        if tensor is not None
    ]


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


def take_attribute_assignments(root: nn.Module, before: Buffers) -> list[tuple[str, torch.Tensor | None]]:
    """After the traced forward: the buffers and plain attributes it assigned, as (path, new
    value), each put back to the value it had."""
    assigned: list[tuple[nn.Module, str, torch.Tensor | None]] = []
    for module, name, old in before:
        new = module._buffers.get(name)
        if new is not old:
            assigned.append((module, name, new))
            module._buffers[name] = old
    if not assigned:
        return []
    paths: dict[int, str] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    return [(_dotted(paths[id(module)], name), new) for module, name, new in assigned]


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


def assigned_tensor_paths(spec: Any) -> tuple[str, ...]:
    """The paths of the assigned attributes that hold tensors, in the order a call returns them
    (none where ``spec`` is not an :class:`AssignedAttributes`)."""
    if not isinstance(spec, AssignedAttributes):
        return ()
    return tuple(path for path, holds in zip(spec.paths, spec.holds_tensor, strict=True) if holds)
