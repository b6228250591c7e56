"""Second-order gradients through ORTModule: a gradient penalty differentiates its gradient again.

A gradient penalty (WGAN-GP, StyleGAN's R1) asks for the gradient of a model's output with
respect to its input with ``create_graph=True``, then backpropagates through that gradient. The
captured backward graph cannot be differentiated (AOTAutograd refuses: "does not currently support
double backward"), so such a step would fail. When an input of the call requires grad (the one
case where the penalty's first gradient starts), the captured call runs inside
:class:`_TwiceDifferentiable`: an ordinary backward runs the captured backward graph as before; a
backward under ``create_graph=True`` recomputes the forward in PyTorch, with the random state,
the autocast state and the buffer values the captured forward started from, and differentiates
that, with a graph, as ``torch.utils.checkpoint`` does. Costs on the ordinary path: one autograd
node and the references it saves (the call's tensors and the parameters that require grad,
released by the backward as eager releases them), and, per step, a copy of the buffers the
forward writes (BatchNorm's statistics, spectral norm's power-iteration vectors) so that the
recompute starts where the forward did.

A forward's Python side effects (a counter it increments, a list it appends to) happen once more
in the recompute; its buffer writes do not (they go to copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ortrain.ortmodule.schema import Spec, flatten_inputs, flatten_outputs, unflatten


class BufferWrites:
    """Which buffers of a model its forward writes, learned from their version counters.

    Until a forward has been seen, every buffer is copied before it; afterwards only the ones a
    forward wrote. A buffer a forward writes for the first time later (no copy was taken) makes
    that step's recompute refuse, by name."""

    def __init__(self) -> None:
        self.written: set[str] | None = None

    def before(self, module: nn.Module) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        buffers = dict(module.named_buffers())
        versions = {name: b._version for name, b in buffers.items()}
        copied = {
            name: b.detach().clone()
            for name, b in buffers.items()
            if self.written is None or name in self.written
        }
        return versions, copied

    def after(self, module: nn.Module, versions: dict[str, int]) -> set[str]:
        written = {
            name for name, b in module.named_buffers() if name not in versions or b._version != versions[name]
        }
        self.written = written if self.written is None else self.written | written
        return written


class _Recompute:
    """What re-running one captured call in PyTorch needs: the call's structure (its tensors are
    saved on the node), the random state and the starting values of the buffers it writes."""

    def __init__(
        self,
        run: Callable[[], Sequence[torch.Tensor]],
        module: nn.Module,
        input_spec: Spec,
        buffer_writes: BufferWrites,
    ) -> None:
        self.run = run
        self.module = module
        self.input_spec = input_spec
        self.buffer_writes = buffer_writes
        self.devices: list[int] = []
        self.cpu_rng = torch.random.get_rng_state()
        # The backward runs outside the user's autocast region: the recompute enters it again.
        self.autocast = {
            device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda")
        }
        self.cuda_rng: list[torch.Tensor] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.unreproducible: list[str] = []
        self.outputs_with_graph: list[bool] = []

    def forward(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        self.devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        versions, copied = self.buffer_writes.before(self.module)
        outputs = self.run()
        written = self.buffer_writes.after(self.module, versions)
        self.buffers = {name: copied[name] for name in written if name in copied}
        self.unreproducible = sorted(written - copied.keys())
        return outputs

    def eager_outputs(self, user_inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.unreproducible:
            raise RuntimeError(
                "backward(create_graph=True) through ORTModule recomputes the forward in PyTorch, "
                "but this forward wrote buffers it had not written before "
                f"({', '.join(self.unreproducible)}), so their starting values were not kept; "
                "the next step's forward keeps them"
            )
        args, kwargs = unflatten(self.input_spec, list(user_inputs))
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices))
            torch.random.set_rng_state(self.cpu_rng)
            for device, state in zip(self.devices, self.cuda_rng, strict=True):
                torch.cuda.set_rng_state(state, device)
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            # Copies again: a retained graph may be differentiated twice.
            buffers = {name: value.clone() for name, value in self.buffers.items()}
            out = torch.func.functional_call(self.module, buffers, args, kwargs, strict=False)
        flat, _ = flatten_outputs(out)
        return flat


class _TwiceDifferentiable(torch.autograd.Function):
    """The captured call as one autograd node whose backward can itself be differentiated.

    Its inputs are the tensors the captured call binds (the model's, then the call's); saved are
    the captured outputs that have a graph, then the call's own tensors (the recompute's inputs).
    The model's parameters are read off the model by the recompute, as its forward reads them."""

    @staticmethod
    def forward(
        ctx: Any, recompute: _Recompute, user_inputs: Sequence[torch.Tensor], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        with torch.enable_grad():
            outputs = recompute.forward(tensors)
        differentiable = [o for o in outputs if o.requires_grad]
        recompute.outputs_with_graph = [o.requires_grad for o in outputs]
        # Saved, the captured graph lives as long as the node's saved tensors: an ordinary backward
        # frees them, one with retain_graph=True keeps them. So are the tensors whose gradients
        # the backward returns (kept on the node, a block's input would outlive its backward).
        wanted = [t for t in tensors if t.requires_grad]
        ctx.save_for_backward(*differentiable, *wanted, *user_inputs)
        ctx.recompute = recompute
        ctx.counts = (len(differentiable), len(wanted))
        ctx.wanted = [t.requires_grad for t in tensors]
        returned = tuple(o.detach() if o.requires_grad else o for o in outputs)
        ctx.mark_non_differentiable(*(r for r, o in zip(returned, outputs, strict=True) if r is o))
        return returned

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        recompute: _Recompute = ctx.recompute
        saved = ctx.saved_tensors
        n_outputs, n_wanted = ctx.counts
        wanted = saved[n_outputs : n_outputs + n_wanted]
        if torch.is_grad_enabled():  # create_graph=True
            outputs: list[torch.Tensor | None] = list(recompute.eager_outputs(saved[n_outputs + n_wanted :]))
            if len(outputs) != len(grads):
                raise RuntimeError(
                    f"backward(create_graph=True) through ORTModule: the forward recomputed in "
                    f"PyTorch returned {len(outputs)} tensors, the captured one {len(grads)}"
                )
        else:
            captured = iter(saved[:n_outputs])
            outputs = [next(captured) if has else None for has in recompute.outputs_with_graph]
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=True)
            if g is not None and o is not None and o.requires_grad
        ]
        found: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            found = torch.autograd.grad(
                [o for o, _ in pairs],
                wanted,
                [g for _, g in pairs],
                retain_graph=True,  # freed with this node's saved tensors, or kept with them
                create_graph=torch.is_grad_enabled(),
                allow_unused=True,
            )
        by_tensor = iter(found)
        return (None, None, *(next(by_tensor) if w else None for w in ctx.wanted))


def needs_second_order_path(inputs: Sequence[torch.Tensor]) -> bool:
    """A gradient with respect to an input is where a gradient penalty starts."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def run_twice_differentiable(
    run: Callable[[], Sequence[torch.Tensor]],
    module: nn.Module,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    buffer_writes: BufferWrites,
    tensors: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...] | None:
    """``run()`` (the captured call over ``tensors``, the model's then the call's) whose outputs'
    gradients can be differentiated again (see the module docstring); None, having run nothing,
    where a tensor that requires grad is neither a parameter of the model nor a tensor of the
    call (the recompute would not reach it: its second-order gradient would be lost)."""
    user_inputs, spec = flatten_inputs(*call)
    reachable = {id(p) for p in module.parameters()} | {id(t) for t in user_inputs}
    if any(t.requires_grad and id(t) not in reachable for t in tensors):
        return None
    return _TwiceDifferentiable.apply(_Recompute(run, module, spec, buffer_writes), user_inputs, *tensors)
