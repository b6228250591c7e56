"""Rewrite a module's forward as an FX graph before AOTAutograd differentiates it.

Rewrites that change what is computed (gather the counted rows before a loss, move a gather up
past token-wise layers) are done here, on the forward alone: AOTAutograd then derives the backward
of the rewritten forward, so the two graphs agree by construction and the gradients are those of
the rewritten forward, which computes the same function.

The module is traced with ``make_fx(pre_dispatch=True)``: ATen ops above autograd, so ``linear``,
``layer_norm``, ``cross_entropy_loss`` and ``embedding`` keep their names and the passes can
recognise layers by their op. When no pass changes anything the original module is captured as
before, so a model without sparsity gets exactly the graphs it got without this stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ortrain.capture.function_calls import inline_function_calls
from ortrain.capture.module_paths import MODULE_KEY

logger = logging.getLogger("ortrain.capture")

# A rewrite edits the graph in place and returns one line per change (empty: nothing changed).
ForwardRewrite = Callable[[torch.fx.GraphModule], list[str]]

# While the rewrites run, each input placeholder's meta holds the call's real tensor under this
# key (a rewrite that pays only for some values decides from them: passes/label_density.py).
INPUT_VALUE = "ortrain_input_value"


@dataclass
class ForwardTrace:
    """The pre-dispatch forward graph: placeholders are the state tensors first, then the inputs."""

    graph_module: torch.fx.GraphModule
    state_count: int
    changes: list[str] = field(default_factory=list)

    @property
    def input_placeholders(self) -> list[torch.fx.Node]:
        placeholders = [n for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        return placeholders[self.state_count :]


class RewrittenCall(nn.Module):
    """Runs the rewritten graph with the wrapped module's own parameters and buffers.

    The wrapped module stays registered under the same attribute (``module``) as in the flat
    call it replaces, so AOTAutograd names the state exactly as it would without the rewrite.
    """

    def __init__(
        self, flat_module: nn.Module, graph_module: torch.fx.GraphModule, *, module_paths: bool = False
    ) -> None:
        super().__init__()
        self.module = flat_module.module  # type: ignore[assignment]
        object.__setattr__(self, "_graph_module", graph_module)
        object.__setattr__(self, "_module_paths", module_paths)

    def forward(self, *inputs: torch.Tensor) -> Any:
        state = [t for _, t in self.named_parameters(remove_duplicate=False)]
        state += [t for _, t in self.named_buffers(remove_duplicate=False)]
        if self._module_paths:
            return _ModulePathInterpreter(self._graph_module).run(state, *inputs)
        return self._graph_module(state, *inputs)


class _ModulePathInterpreter(torch.fx.Interpreter):
    """Runs the rewritten graph node by node under each node's submodule path, so that the joint
    graph AOTAutograd traces from it names its layers as a capture of the module itself does
    (the memory optimizer's per-layer summary reads them)."""

    def run_node(self, n: torch.fx.Node) -> Any:
        path = (n.meta.get("custom") or {}).get(MODULE_KEY)
        if path is None:
            return super().run_node(n)
        with fx_traceback.annotate({MODULE_KEY: path}):
            return super().run_node(n)


def _state(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    names, tensors = [], []
    for name, tensor in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        names.append(name)
        tensors.append(tensor)
    return names, tensors


def trace_forward(
    flat_module: nn.Module, example: Sequence[torch.Tensor], *, module_paths: bool = False
) -> ForwardTrace | None:
    """The flat module's forward as a pre-dispatch ATen graph, or None where it cannot be traced.

    ``flat_module`` holds the user's model as ``flat_module.module``. Fake (symbolic) examples
    give a graph whose sizes are symbolic too. ``module_paths``: nodes keep the submodule path
    that ``annotate_module_paths`` gives them (costs time: see :func:`rewrite_forward`).
    """
    holder = nn.Module()
    holder.module = flat_module.module
    names, tensors = _state(holder)

    def call(state: list[torch.Tensor], *inputs: torch.Tensor) -> Any:
        return torch.func.functional_call(flat_module, dict(zip(names, state, strict=True)), inputs)

    # Fake tensors only: running the model for real would, for one, update BatchNorm statistics.
    fake_mode = next((t.fake_mode for t in example if isinstance(t, FakeTensor)), None)
    if fake_mode is None:
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        example = [fake_mode.from_tensor(t, static_shapes=True) for t in example]
    tensors = [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]
    try:
        # preserve_node_meta: each node keeps the submodule path that annotate_module_paths (active
        # around the capture) gives it, which RewrittenCall hands on to the joint graph.
        with fx_traceback.preserve_node_meta(module_paths):
            gm = make_fx(call, pre_dispatch=True, tracing_mode="symbolic")(tensors, *example)
    except Exception as error:  # any failure means: capture the module as it is
        # The first line: torch's errors go on with pages of debugging advice for its own users.
        first_line = next((line for line in str(error).splitlines() if line.strip()), "")
        logger.info(
            "forward rewrites skipped: the pre-dispatch trace failed (%s: %s)",
            type(error).__name__,
            first_line,
        )
        logger.debug("the pre-dispatch trace's error", exc_info=error)
        return None
    foreign = sorted(
        {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and not _is_plain_op(n.target)}
    )
    if foreign:
        logger.info("forward rewrites skipped: the graph holds %s", ", ".join(foreign))
        return None
    lost = sorted(str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and _is_fake(gm, n.target))
    if lost:
        # A fake constant is a value the trace computed without recording how: pre-dispatch
        # tracing does not follow torch.vmap (torch's generic associative_scan, which Hugging
        # Face's Mamba uses under tracing, is one), so the graph reads a placeholder where it
        # should compute. AOTAutograd's own trace follows it; the module is captured as written.
        logger.info(
            "forward rewrites skipped: the pre-dispatch trace lost the computation of %s (torch.vmap?)",
            ", ".join(lost),
        )
        return None
    return ForwardTrace(gm, len(tensors))


def _is_fake(gm: torch.fx.GraphModule, target: str) -> bool:
    owner, _, name = target.rpartition(".")
    return isinstance(getattr(gm.get_submodule(owner) if owner else gm, name, None), FakeTensor)


_SIZE_FUNCTIONS = {
    torch.sym_max,
    torch.sym_min,
    torch.sym_not,
    torch.sym_float,
    torch.sym_int,
    torch.sym_ite,
    torch._sym_sqrt,  # math.sqrt of an open size (ortrain/capture/size_math.py)
}


def _is_plain_op(target: Any) -> bool:
    """ATen ops and size arithmetic; not python ops, checkpoint regions or other higher-order ops."""
    if getattr(target, "__module__", None) in ("_operator", "math") or target in _SIZE_FUNCTIONS:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in ("aten", "prims")
    return False


def rewrite_forward(
    flat_module: nn.Module,
    example: Sequence[torch.Tensor],
    rewrites: Sequence[ForwardRewrite],
    *,
    module_paths: bool = False,
    values: Sequence[torch.Tensor] = (),
) -> tuple[nn.Module, ForwardTrace | None]:
    """Apply ``rewrites`` to the traced forward; the module AOTAutograd should capture, and the trace.

    Returns ``flat_module`` itself when nothing changed (or nothing could be traced).
    ``module_paths``: the joint graph AOTAutograd traces from the rewritten forward names each
    node's submodule, as a capture of the module itself does (the memory optimizer's per-layer
    summary). Measured on the tiny GPT: +0.16 s to a first capture, +0.7 s to a symbolic one.
    ``values``: the call's real inputs, which the rewrites see as :data:`INPUT_VALUE`.
    """
    inline_before = inline_function_calls()
    trace = trace_forward(flat_module, example, module_paths=module_paths)
    if trace is None or not rewrites:
        return flat_module, trace
    if inline_function_calls() != inline_before:
        # The trace holds such a Function's forward as plain operators: AOTAutograd would
        # differentiate those in a rewritten forward, not call the Function's backward (wave 48's
        # review: a gradient-scaling Function's factor lost next to the linear + cross-entropy
        # rewrite, silently). The module itself, captured as written, keeps the Function.
        logger.info(
            "forward rewrites skipped: the forward calls a torch.autograd.Function traced inline, "
            "whose own backward a rewritten forward would lose"
        )
        return flat_module, trace
    placeholders = trace.input_placeholders if len(values) == len(trace.input_placeholders) else []
    for node, tensor in zip(placeholders, values, strict=False):
        if not isinstance(tensor, FakeTensor):
            node.meta[INPUT_VALUE] = tensor
    try:
        for rewrite in rewrites:
            trace.changes += rewrite(trace.graph_module)
    finally:  # the trace outlives the capture (the inspector reads it): it keeps no batch alive
        for node in placeholders:
            node.meta.pop(INPUT_VALUE, None)
    if not trace.changes:
        return flat_module, trace
    trace.graph_module.graph.eliminate_dead_code()
    trace.graph_module.graph.lint()
    trace.graph_module.recompile()
    return RewrittenCall(flat_module, trace.graph_module, module_paths=module_paths), trace
