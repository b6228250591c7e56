"""A forward that assigns a new tensor to a buffer (``self.ema = self.ema * 0.9 + 0.1 * x``).

Eager PyTorch keeps the new tensor in the module. A capture traces the forward with the buffers
swapped for graph inputs (AOTAutograd's ``functional_call``), and puts the real buffers back
afterwards: the assignment lands in the swapped-in dictionary entry and is lost, so the buffer
never changes and every later step reads its first value (a moving average that does not move,
with the wrong loss and gradients from the second step on).

Within the traced forward, each buffer assigned a new tensor of the same shape, dtype and device
is therefore copied into (``old.copy_(new)``) and put back: an in-place update of a graph input,
which AOTAutograd writes back into the real buffer after every run, as it does for BatchNorm's
running statistics. The copy is made without gradient: the buffer holds the value, not the graph
that computed it (a forward that read it at the next step would, in eager PyTorch, backpropagate
into a graph already freed). A plain tensor attribute is a buffer during a capture
(:mod:`ortrain.capture.tensor_attributes`); one assigned in the forward is an output of the graph
instead (:mod:`ortrain.capture.attribute_assignments`), and one that views a parameter
(spectral_norm's ``weight``, recomputed by its pre-hook before each use) is left as it was.
An assignment that changes the shape, dtype or device cannot be an update of the same input, and
is refused with what to do.
"""

from __future__ import annotations

import torch
from torch import nn

from ortrain.capture.tensor_attributes import is_parameter_view
from ortrain.errors import ORTModuleTorchModelException

Buffers = list[tuple[nn.Module, str, torch.Tensor]]


def buffers_before(root: nn.Module) -> Buffers:
    """Every buffer of ``root`` and its submodules, with its owner and name, before the forward."""
    return [
        (module, name, tensor)
        for module in root.modules()
        for name, tensor in module._buffers.items()
        if tensor is not None
    ]


def keep_assignments_as_updates(before: Buffers) -> None:
    """After the forward: copy each newly assigned buffer into the tensor it replaced."""
    for module, name, old in before:
        new = module._buffers.get(name)
        if new is old or old.requires_grad or is_parameter_view(module, name):
            # A buffer that requires grad holds a value computed from the parameters: updating it
            # in place would tie this step's graph to the one that made it. A tensor attribute that
            # views a parameter (spectral_norm's ``weight``) would have the update written into the
            # parameter. (Other tensor attributes the forward assigns, pruning's ``weight`` among
            # them, are graph outputs: ortrain.capture.attribute_assignments.)
            continue
        if not isinstance(new, torch.Tensor) or (new.dtype, new.device) != (old.dtype, old.device):
            raise ORTModuleTorchModelException(_refusal(module, name, old, new))
        if new.shape != old.shape:
            raise ORTModuleTorchModelException(_refusal(module, name, old, new))
        with torch.no_grad():
            old.copy_(new)
        module._buffers[name] = old


def _refusal(module: nn.Module, name: str, old: torch.Tensor, new: object) -> str:
    def show(t: object) -> str:
        if not isinstance(t, torch.Tensor):
            return type(t).__name__
        sizes = "x".join(str(s) for s in t.shape)
        return f"[{sizes}] {t.dtype} tensor on {t.device}"

    return (
        f"the forward of {type(module).__name__} assigns its buffer '{name}' a {show(new)} where it held "
        f"a {show(old)}: a captured graph takes each buffer as an input of fixed dtype and device and "
        "writes updates back into it. Keep the buffer's dtype and device (and shape), update it in "
        "place (`self.buf.copy_(...)`), or register it at its final size before training."
    )
