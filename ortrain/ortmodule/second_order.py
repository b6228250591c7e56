"""Second-order gradients through ORTModule: a gradient differentiated again.

A gradient penalty asks for a gradient with ``create_graph=True``, then backpropagates through
it: with respect to the input (WGAN-GP, StyleGAN's R1) or to the parameters (a gradient-norm
penalty, second-order MAML). The captured backward graph cannot be differentiated (AOTAutograd
refuses: "does not currently support double backward"), so every training call runs inside
:class:`_TwiceDifferentiable`: an ordinary backward runs the captured backward graph as before
(freeing each saved activation after its last use unless the outer backward retains the graph); a
backward under ``create_graph=True`` recomputes the forward in PyTorch, with the random state,
the autocast state, the parameters and the buffer values the captured forward started from, and
differentiates that, with a graph, as ``torch.utils.checkpoint`` does. Costs on the ordinary
path: one autograd node and the references it saves (the call's tensors and the parameters that
require grad, released by the backward as eager releases them), and, per step, a copy of the
buffers the forward writes (BatchNorm's statistics, spectral norm's power-iteration vectors) so
that the recompute starts where the forward did.

A forward's Python side effects (a counter it increments, a list it appends to) happen once more
in the recompute; its buffer writes do not (they go to copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ortrain.capture.functorch_transforms import any_batched, functorch_transform_active
from ortrain.capture.graph_task import backward_keeps_graph
from ortrain.ortmodule.output_aliases import (
    InputAliases,
    Layout,
    as_views,
    from_inputs,
    input_aliases,
    output_aliases,
)
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
        # An inference tensor (a buffer set under ``torch.inference_mode()``) has no version
        # counter, and reading it raised (wave 50's review); nothing can write into it in place
        # outside that mode, so it is written only if replaced.
        versions = {name: b._version for name, b in buffers.items() if not b.is_inference()}
        copied = {
            name: b.detach().clone()
            for name, b in buffers.items()
            if self.written is None or name in self.written
        }
        return versions, copied

    def after(self, module: nn.Module, versions: dict[str, int]) -> set[str]:
        written = {
            name
            for name, b in module.named_buffers()
            if name not in versions or b.is_inference() or b._version != versions[name]
        }
        self.written = written if self.written is None else self.written | written
        return written


class _Recompute:
    """What re-running one captured call in PyTorch needs: the call's structure (its tensors are
    saved on the node), the random state and the starting values of the buffers it writes."""

    def __init__(
        self,
        run: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]],
        module: nn.Module,
        parameters: dict[str, torch.Tensor],
        input_spec: Spec,
        buffer_writes: BufferWrites,
        changed_since: Callable[[], str | None],
        assigned: tuple[str, ...] = (),
        versions_kept: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.run = run
        self.module = module
        self.versions_kept = versions_kept
        self.parameters = parameters
        # The version of each tensor the call read, by identity, after the forward: a backward
        # refused for a tensor written in place since names it (parameter or buffer). Only ints are
        # kept on every call; the names are looked up on the refusal alone (a list of names and
        # tensors built here cost ~85 us a call on a 4-layer GPT).
        self.read_versions: dict[int, int] = {}
        # The buffers and attributes the forward assigns a tensor, with the values they hold now,
        # before the forward: the captured call read those, returns the new ones after its own
        # outputs (ortrain.capture.attribute_assignments), and the module holds the new ones by
        # the time a backward recomputes it.
        self.assigned = _current_values(module, assigned)
        # What changed in the model since this call (None: nothing its graph depends on).
        self.changed_since = changed_since
        self.input_spec = input_spec
        # The parameters this call reads, by name (under torch.func.functional_call, the ones it
        # passed): those that require grad are saved on the node, the others kept here.
        self.trained = [name for name, p in parameters.items() if p.requires_grad]
        self.trained_values = [parameters[name] for name in self.trained]
        self.frozen = {name: p for name, p in parameters.items() if not p.requires_grad}
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
        self.captured: list[torch.Tensor | None] | None = None
        self.leaves: list[torch.Tensor] | None = None
        # Outputs that share memory with others (see :mod:`ortrain.ortmodule.output_aliases`).
        self.aliases: dict[int, tuple[int, Layout]] = {}
        # Outputs that are the node's tensors or views of them (input_aliases).
        self.input_aliases: InputAliases = {}

    def forward(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        self.devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        versions, copied = self.buffer_writes.before(self.module)
        # BatchNorm's running statistics keep their version counters, as after eager's kernel
        # (ortrain.capture.running_statistics): the buffer writes are learned inside, where the
        # counters still show them.
        with self.versions_kept():
            outputs = self.run(tensors)
            written = self.buffer_writes.after(self.module, versions)
        self.buffers = {name: copied[name] for name in written if name in copied}
        self.unreproducible = sorted(written - copied.keys())
        return outputs

    def refuse_model_changes(self) -> None:
        changed = self.changed_since()
        if changed is not None:
            # The recompute runs the model as it is now: after ``model.eval()`` or a new hook,
            # the penalty of another function (wave 49's review: no error, a penalty half of
            # eager's).
            raise RuntimeError(
                "backward(create_graph=True) through ORTModule recomputes the forward in PyTorch, "
                f"and the model changed since that forward ({changed}); make such changes after "
                "the backward, or before the forward"
            )

    def eager_outputs(
        self, user_inputs: Sequence[torch.Tensor], trained: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
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
            # The Python the model's torch.compile compiles, as the capture traces it: TorchDynamo
            # cannot differentiate its own graphs twice ("does not currently support double
            # backward"; ORTModule(torch.compile(model)) failed where ORTModule(model) trains).
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            torch.random.set_rng_state(self.cpu_rng)
            for device, state in zip(self.devices, self.cuda_rng, strict=True):
                torch.cuda.set_rng_state(state, device)
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            # Copies again: a retained graph may be differentiated twice.
            state = {name: value.clone() for name, value in self.buffers.items()}
            # Detached: a parameter unfrozen since the forward gets no gradient eager would not
            # give it (the forward's graph did not reach it).
            state.update({name: p.detach() for name, p in self.frozen.items()})
            state.update(zip(self.trained, trained, strict=True))
            assigned = stack.enter_context(_assignments_taken(self.module, self.assigned))
            out = torch.func.functional_call(self.module, state, args, kwargs, strict=False)
        flat, _ = flatten_outputs(out)
        return [*flat, *assigned]


_Assigned = list[tuple[nn.Module, str, Any]]


def _current_values(module: nn.Module, paths: tuple[str, ...]) -> _Assigned:
    """(owner, name, value) of each dotted path below ``module``."""
    located = []
    for path in paths:
        prefix, _, name = path.rpartition(".")
        owner = module.get_submodule(prefix)
        located.append((owner, name, getattr(owner, name)))
    return located


@contextlib.contextmanager
def _assignments_taken(module: nn.Module, before: _Assigned) -> Iterator[list[torch.Tensor]]:
    """Within the block, the assigned buffers and attributes hold their values from before the
    forward (the ones the captured call read), and the tensors the forward run inside assigns them
    are collected, as the captured call returns them after its outputs (read when the forward
    returns, before ``functional_call`` puts the swapped buffers back); afterwards the module holds
    what it held at the start, the captured call's new values. (Wave 50's review: a gradient
    penalty through a model replacing a buffer compared one recomputed output with two captured
    ones, then recomputed with the buffer's new value: a wrong penalty, silently.)"""
    taken: list[torch.Tensor] = []
    if not before:
        yield taken
        return
    now = [(owner, name, getattr(owner, name)) for owner, name, _ in before]
    for owner, name, value in before:
        setattr(owner, name, value)
    handle = module.register_forward_hook(
        lambda *_: taken.extend(getattr(owner, name) for owner, name, _ in before)
    )
    try:
        yield taken
    finally:
        handle.remove()
        for owner, name, value in now:
            setattr(owner, name, value)


class _TwiceDifferentiable(torch.autograd.Function):
    """The captured call as one autograd node whose backward can itself be differentiated.

    Its inputs are the tensors the captured call binds (the model's, then the call's). Saved are
    the tensors whose gradients it returns, the call's own tensors and the parameters that require
    grad (the recompute's inputs); the captured outputs and the leaves they were computed from are
    held on the recompute."""

    @staticmethod
    def forward(
        ctx: Any, recompute: _Recompute, user_inputs: Sequence[torch.Tensor], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        # The captured call runs on leaves of its own (aliases, no copies): its backward stops
        # there, and the hooks on the model's tensors run once, when the node hands them their
        # gradients (computed up to the tensors themselves, a parameter's hook ran twice).
        # Each tensor that requires grad once, with its leaf: autograd.grad gives a tensor listed
        # twice (a tied weight bound under both names) its whole gradient twice, which the node
        # would then return twice.
        place: dict[int, int] = {}  # id of a tensor that requires grad -> its place in ``wanted``
        wanted: list[torch.Tensor] = []
        ctx.positions = []  # per tensor: its place in ``wanted``, or None (no grad, or a repeat)
        for t in tensors:
            first = t.requires_grad and id(t) not in place
            if first:
                place[id(t)] = len(wanted)
                wanted.append(t)
            ctx.positions.append(place[id(t)] if first else None)
        leaves = [t.detach().requires_grad_() for t in wanted]
        passed = [leaves[place[id(t)]] if t.requires_grad else t for t in tensors]
        with torch.enable_grad():
            outputs = recompute.forward(passed)
        # By the model's own tensors (``passed`` holds aliases of those that require grad), after
        # the forward's writes.
        recompute.read_versions = {id(t): t._version for t in tensors if not t.is_inference()}
        # Held on the node, not saved: the user may write into an output (the Hugging Face Trainer
        # scales its loss in place), which eager allows when nothing saved it. The backward drops
        # them unless the outer backward keeps its graph.
        recompute.captured = [o if o.requires_grad else None for o in outputs]
        recompute.leaves = leaves
        recompute.aliases = output_aliases(outputs)
        recompute.input_aliases = input_aliases(outputs, passed)
        # Saved: the tensors whose gradients the backward returns (kept on the node, a block's
        # input would outlive its backward), the call's own tensors and the parameters that
        # require grad (the recompute's inputs).
        # An inference tensor cannot be saved (a teacher's logits made under inference_mode, passed
        # to the student: wave 47's review, "Inference tensors cannot be saved for backward" at
        # every step); autograd never writes into one, so it is held as it is.
        ctx.inference_inputs = {i: t for i, t in enumerate(user_inputs) if t.is_inference()}
        saved_inputs = [None if i in ctx.inference_inputs else t for i, t in enumerate(user_inputs)]
        ctx.save_for_backward(*wanted, *saved_inputs, *recompute.trained_values)
        # The recompute's sources (the call's tensors, then the trained parameters) by place, not
        # by identity: under saved-tensor hooks (``save_on_cpu()``, a non-reentrant checkpoint
        # around the call) each saved tensor unpacks as an object of its own, so one tensor saved
        # twice (among ``wanted`` and as an input) comes back as two (wave 53's review: KeyError).
        first: dict[int, int] = {}
        for i, t in enumerate((*user_inputs, *recompute.trained_values)):
            first.setdefault(id(t), i)
        ctx.sources = [first[id(t)] for t in (*user_inputs, *recompute.trained_values)]
        ctx.wanted_sources = [first[id(t)] for t in wanted]
        recompute.trained_values = []
        ctx.recompute = recompute
        ctx.counts = (len(wanted), len(user_inputs))
        returned = tuple(o.detach() if o.requires_grad else o for o in outputs)
        ctx.mark_non_differentiable(*(r for r, o in zip(returned, outputs, strict=True) if r is o))
        return returned

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        recompute: _Recompute = ctx.recompute
        keep = backward_keeps_graph()
        # Under vmap (``autograd.grad(..., is_grads_batched=True)``, ``jacobian(vectorize=True)``)
        # the gradients are functorch's batched tensors, which no captured graph can take (wave 42:
        # "Cannot access data pointer" from ONNX Runtime's executor): the recompute in PyTorch
        # differentiates them, as it does for create_graph=True.
        batched = not torch.is_grad_enabled() and (functorch_transform_active() or any_batched(grads))
        if torch.is_grad_enabled() or batched:
            # Unpacked here only: unpacking checks that no saved tensor was written in place since
            # the forward, which the recompute needs. The first-order backward reads none of them
            # (its captured graph checks what it saved itself), and checking them all refused a
            # step eager runs: a parameter no gradient reads, changed between forward and
            # backward (wave 37).
            saved = ctx.saved_tensors
            n_wanted, n_inputs = ctx.counts
            wanted, user_inputs = saved[:n_wanted], list(saved[n_wanted : n_wanted + n_inputs])
            for i, t in ctx.inference_inputs.items():
                user_inputs[i] = t
            trained = saved[n_wanted + n_inputs :]
            with torch.enable_grad() if batched else contextlib.nullcontext():
                outputs, wanted = _recomputed(
                    recompute, user_inputs, trained, ctx.sources, ctx.wanted_sources, len(grads)
                )
        elif recompute.captured is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time: an ORTModule call's captured "
                "graph is freed by its first backward; specify retain_graph=True to keep it"
            )
        else:
            outputs, wanted = recompute.captured, recompute.leaves
            if not keep:  # its saved activations are freed as the captured backward runs
                recompute.captured = recompute.leaves = None
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=True)
            if o is not None and g is not None and o.requires_grad
        ]
        found: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            try:
                found = torch.autograd.grad(
                    [o for o, _ in pairs],
                    wanted,
                    [g for _, g in pairs],
                    retain_graph=keep or torch.is_grad_enabled(),
                    create_graph=torch.is_grad_enabled(),
                    allow_unused=True,
                )
            except RuntimeError as error:
                if "modified by an inplace operation" not in str(error):
                    raise
                raise RuntimeError(f"{error}\n{_written_since_the_forward(recompute)}") from error
        return (None, None, *(None if at is None else found[at] for at in ctx.positions))


# An actor-critic's ``actor_loss.backward(retain_graph=True); actor_optimizer.step();
# critic_loss.backward()``: eager runs it when the critic's loss does not reach the actor's head;
# the captured forward is one node whose graph saved every weight it read (wave 45's review: the
# error alone named neither ortrain nor a way out; torch.compile refuses it the same way).
_ONE_GRAPH = "ortrain: the wrapped model's forward is one captured graph, which saved the tensors it read. "
_PARAMETER_WRITTEN = (
    "Its {weights} changed in place after this forward and before this backward (an "
    "optimizer.step() between two backward passes through the same forward, say), which the graph "
    "refuses even where this backward does not read the weight: step the optimizers after the last "
    "backward, or backward the sum of the losses once"
)
# Wave 54's review: the note blamed an optimizer step for a buffer. (BatchNorm's running
# statistics, which eager's kernel writes without moving their counters, no longer move them here
# either: ortrain.capture.running_statistics.)
_BUFFER_WRITTEN = (
    "Its {buffers} written in place after this forward and before this backward (by a later call "
    "of the model that updates it, or by code outside the model); eager refuses such a write where "
    "its backward reads the buffer, the graph even where this backward does not: run this backward "
    "before the buffer is written, or have the forward read a copy of it (`self.buffer.clone()`)"
)
_INPUT_WRITTEN = (
    "A tensor it read (one of the call's inputs) was changed in place after this forward and before "
    "this backward: run the backward first, or pass the call a copy (`x.clone()`)"
)


def _named(kind: str, names: list[str]) -> str:
    """``weight `a` was`` or ``weights `a`, `b` were``."""
    return f"{kind} {names[0]} was" if len(names) == 1 else f"{kind}s {', '.join(names)} were"


def _written_since_the_forward(recompute: _Recompute) -> str:
    """What was written in place between the forward and this refused backward, and what to do."""
    changed: dict[str, list[str]] = {"parameter": [], "buffer": []}
    named = [
        *(("parameter", name, p) for name, p in recompute.parameters.items()),
        *(("buffer", name, b) for name, b in recompute.module.named_buffers()),
    ]
    for kind, name, tensor in named:
        version = recompute.read_versions.get(id(tensor))
        if version is not None and tensor._version != version:
            changed[kind].append(f"`{name}`")
    notes = []
    if changed["parameter"]:
        notes.append(_PARAMETER_WRITTEN.format(weights=_named("weight", changed["parameter"])))
    if changed["buffer"]:
        notes.append(_BUFFER_WRITTEN.format(buffers=_named("buffer", changed["buffer"])))
    return _ONE_GRAPH + ". ".join(notes or [_INPUT_WRITTEN])


def _recomputed(
    recompute: _Recompute,
    user_inputs: Sequence[torch.Tensor],
    trained: Sequence[torch.Tensor],
    sources: Sequence[int],
    wanted_sources: Sequence[int],
    count: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The forward recomputed in PyTorch on aliases of the call's tensors and parameters (views:
    the graph reaches the tensors through them, and differentiating up to the aliases leaves the
    tensors' own hooks to run once, at the node's edges), and the aliases of the tensors whose
    gradients the node returns. ``sources[i]``: the place of the first of ``user_inputs`` then
    ``trained`` that was the same tensor as the i-th in the forward (one alias for a tensor passed
    twice); ``wanted_sources``: the place of each tensor whose gradient is returned."""
    recompute.refuse_model_changes()
    tensors = [*user_inputs, *trained]
    # A parameter frozen since the forward: eager differentiates the graph built while it required
    # grad, which reaches it, and it accumulates there if it requires grad again by the backward
    # (a GAN freezing its discriminator only while the penalty's gradient is taken). The recompute
    # builds its graph with the flag as the forward had it.
    revived = [t for t in trained if not t.requires_grad and t.is_leaf]
    for t in revived:
        t.requires_grad_(True)
    try:
        # aten.alias, not view_as: its backward passes a sparse gradient (an
        # Embedding(sparse=True) weight's) through, where ViewBackward reshapes it, which sparse
        # tensors refuse.
        aliases = {
            place: torch.ops.aten.alias(tensors[place])
            for place in dict.fromkeys(sources)
            if tensors[place].requires_grad
        }
        passed = [aliases.get(place, t) for place, t in zip(sources, tensors, strict=True)]
        outputs = recompute.eager_outputs(passed[: len(user_inputs)], passed[len(user_inputs) :])
    finally:
        for t in revived:
            t.requires_grad_(False)
    if len(outputs) != count:
        raise RuntimeError(
            f"backward(create_graph=True) through ORTModule: the forward recomputed in "
            f"PyTorch returned {len(outputs)} tensors, the captured one {count}"
        )
    return outputs, [aliases[place] for place in wanted_sources]


def needs_second_order_path() -> bool:
    """Every call that builds a graph: a gradient penalty may start at an input (WGAN-GP, R1) or
    at the parameters (a gradient-norm penalty, second-order MAML)."""
    return torch.is_grad_enabled()


def run_twice_differentiable(
    run: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]],
    module: nn.Module,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    buffer_writes: BufferWrites,
    tensors: Sequence[torch.Tensor],
    changed_since: Callable[[], str | None] = lambda: None,
    assigned: tuple[str, ...] = (),
    versions_kept: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[torch.Tensor, ...] | None:
    """``run(tensors)`` (the captured call over ``tensors``, the model's then the call's) whose outputs'
    gradients can be differentiated again (see the module docstring); None, having run nothing,
    where a tensor that requires grad is neither a parameter of the model nor a tensor of the
    call (the recompute would not reach it: its second-order gradient would be lost).
    ``versions_kept()`` is entered around ``run``: the capture's running statistics keep their
    version counters (ortrain.capture.running_statistics)."""
    user_inputs, spec = flatten_inputs(*call)
    parameters = dict(module.named_parameters())
    reachable = {id(p) for p in parameters.values()} | {id(t) for t in user_inputs}
    if any(t.requires_grad and id(t) not in reachable for t in tensors):
        return None
    recompute = _Recompute(
        run, module, parameters, spec, buffer_writes, changed_since, assigned, versions_kept
    )
    returned = _TwiceDifferentiable.apply(recompute, user_inputs, *tensors)
    if recompute.input_aliases:
        returned = from_inputs(returned, recompute.input_aliases, tensors)
    # Outputs made from the call's tensors above are views of those, not of another output.
    aliases = {i: a for i, a in recompute.aliases.items() if i not in recompute.input_aliases}
    return as_views(returned, aliases) if aliases else returned
