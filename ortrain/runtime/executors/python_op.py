"""The python op executor: runs ``ortrain::python_op`` / ``ortrain::python_op_grad`` nodes, the
opaque ``torch.autograd.Function`` calls of a captured graph, in PyTorch. It has the highest
priority: no other executor can run a Function's Python code.

The forward kernel calls the Function's own ``apply`` under ``torch.enable_grad()`` on detached
inputs (the same tensors, by pointer) that require grad exactly as they did when traced. That
builds a real autograd graph with a real ``ctx``, which the zero-size handle tensor carries to the
backward. The backward kernel runs ``torch.autograd.backward`` on that graph, so everything the
ctx API promises (``saved_tensors``, ``needs_input_grad``, ``once_differentiable``,
``set_materialize_grads``, ``mark_non_differentiable``, ``mark_dirty``) behaves as in eager mode,
and a Function whose backward itself runs autograd (reentrant checkpointing) works too.

Conventions:
- An input gradient the Function leaves as ``None`` comes back as zeros from the kernel (the
  operator's outputs are tensors); where the capture saw the backward leave it None, the autograd
  formula turns it back into None (see ``_grads_left_none``), and a run-time gradient there raises.
- A graph kept for backward is freed after one backward, as eager's ``retain_graph=False``.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.node import map_aggregate

from ortrain.capture.graph_task import backward_keeps_graph
from ortrain.capture.python_ops import PYTHON_OPS, FunctionCall, call_of, python_op
from ortrain.runtime.executors.base import Runner

logger = logging.getLogger("ortrain.runtime")

_GRAPH_ATTRIBUTE = "_ortrain_autograd_graph"


@dataclass
class _KeptGraph:
    """What the backward needs: the leaves the forward started from, the outputs it made, and the
    tensors the leaves stand for (the graph's inputs: parameters among them)."""

    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]
    sources: list[torch.Tensor]


def _leaf_of(source: torch.Tensor, need: bool) -> torch.Tensor:
    """A leaf of the Function's own graph for ``source``, with ``source``'s Python attributes: a
    backward that accumulates a weight's gradient itself (Megatron's and apex's
    ``gradient_accumulation_fusion``: ``weight.main_grad.add_(...)``) reads them (wave 48's review:
    "'Tensor' object has no attribute 'main_grad'", raised in the backward)."""
    leaf = source.detach().requires_grad_(need)
    attributes = getattr(source, "__dict__", None)
    if attributes:
        leaf.__dict__.update(attributes)
    return leaf


def _attributes_back(kept: _KeptGraph) -> None:
    """Attributes the Function's backward set on a leaf (``weight.grad_added_to_main_grad = True``)
    set on the tensor it stands for, as eager's backward sets them on the parameter itself."""
    for leaf, source in zip(kept.leaves, kept.sources, strict=True):
        for name, value in vars(leaf).items():
            if getattr(source, name, _MISSING) is not value:
                setattr(source, name, value)


_MISSING = object()


def _shares_memory(tensor: torch.Tensor, others: list[torch.Tensor]) -> bool:
    storage = tensor.untyped_storage().data_ptr()
    return storage != 0 and any(o.untyped_storage().data_ptr() == storage for o in others)


def _tensor_outputs(call: FunctionCall, result: Any) -> list[torch.Tensor]:
    outputs = list(result) if isinstance(result, tuple) else [result]
    kinds = ["none" if o is None else "tensor" if isinstance(o, torch.Tensor) else "other" for o in outputs]
    if kinds != call.output_kinds:
        raise RuntimeError(
            f"{call.func_name}: the forward returned {kinds} at run time but {call.output_kinds} when "
            "captured; ortrain needs a Function's outputs to keep their structure"
        )
    return [o for o in outputs if isinstance(o, torch.Tensor)]


def run_forward(call: FunctionCall, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Function's forward; with ``call.keep_ctx``, the last output is the handle."""
    dirty_inputs = set(call.dirty.values())
    if call.keep_ctx:
        leaves = [_leaf_of(t, need) for t, need in zip(inputs, call.needs_grad, strict=True)]
        with torch.enable_grad():
            # mark_dirty needs a non-leaf to update in place; the clone also keeps the op functional.
            args = [leaf.clone() if i in dirty_inputs else leaf for i, leaf in enumerate(leaves)]
            with call.forward_precision():
                result = call.cls.apply(*call.bind(args, numbers=True), **call.kwargs)
    else:
        args = [t.clone() if i in dirty_inputs else t for i, t in enumerate(inputs)]
        with call.forward_precision():
            result = call.cls.apply(*call.bind(args, numbers=True), **call.kwargs)
    outputs = _tensor_outputs(call, result)
    # The graph around the op is functional: an output may not alias an input.
    returned = [o.detach().clone() if _shares_memory(o, inputs) else o.detach() for o in outputs]
    if not call.keep_ctx:
        return returned
    handle = torch.empty((0,), dtype=torch.int64, device=inputs[0].device if inputs else "cpu")
    setattr(handle, _GRAPH_ATTRIBUTE, _KeptGraph(leaves, outputs, list(inputs)))
    return [*returned, handle]


def run_backward(
    call: FunctionCall, handle: torch.Tensor, grad_outputs: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """The Function's backward, on the graph the handle carries; one gradient per input needing it."""
    kept: _KeptGraph | None = getattr(handle, _GRAPH_ATTRIBUTE, None)
    if kept is None:
        raise RuntimeError(
            f"{call.func_name}: its forward graph was already used by a backward; specify "
            "retain_graph=True on the first backward to run it again"
        )
    # ``backward(retain_graph=True)`` keeps the Function's graph for the next backward (wave 47's
    # review: refused, for the recurrent layers ortrain makes opaque too); each backward's
    # gradients are its own.
    keep = backward_keeps_graph()
    if not keep:
        delattr(handle, _GRAPH_ATTRIBUTE)
    for leaf in kept.leaves:
        leaf.grad = None
    written = _gradients_written_in_place(call, kept)
    leaves = [leaf for leaf, need in zip(kept.leaves, call.needs_grad, strict=True) if need]
    pairs = [
        (out, grad)
        for out, grad in zip(kept.outputs, grad_outputs, strict=True)
        if grad is not None and out.requires_grad
    ]
    if pairs:
        # backward, not grad: reentrant checkpointing refuses torch.autograd.grad, and parameters
        # that a Function's backward reaches on its own receive their gradients as in eager mode.
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=keep)
    for k in call.none_grads:
        if k in written.returned or (k not in written.leaves and kept.leaves[k].grad is not None):
            # The capture dropped this gradient because the backward gave None then: never lose it.
            raise RuntimeError(
                f"{call.func_name}: its backward returned a gradient for input {k} at run time but "
                "None when ortrain captured it; set ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 or make the "
                "choice depend on ctx.needs_input_grad only"
            )
    written.hand_over()
    _attributes_back(kept)
    present = [g for g in grad_outputs if g is not None]
    grads = []
    for leaf in leaves:
        grad = leaf.grad
        if grad is None:
            grad = torch.zeros_like(leaf)
        elif _shares_memory(grad, present):
            grad = grad.clone()
        grads.append(grad)
    return grads


@dataclass
class _WrittenGradients:
    """The parameters whose gradient a Function's backward writes itself and returns None for
    (``weight.grad = g.t() @ x``, ``weight.grad.add_(...)``: a fused weight-gradient accumulation):
    its leaf holds the parameter's ``.grad`` while it runs, handed back after it, as eager's
    backward writes the parameter's own (wave 48's review: refused as "returned a gradient at run
    time but None when captured"). A gradient it does return there reaches a hook: ``returned``."""

    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]]
    returned: set[int]

    def hand_over(self) -> None:
        for leaf, source in self.leaves.values():
            if leaf.grad is not source.grad:
                source.grad = leaf.grad
            leaf.grad = None  # the op's output there is the zeros the formula drops


def _gradients_written_in_place(call: FunctionCall, kept: _KeptGraph) -> _WrittenGradients:
    written = _WrittenGradients({}, set())
    for k in call.none_grads:
        leaf, source = kept.leaves[k], kept.sources[k]
        if not (leaf.requires_grad and source.is_leaf and source.requires_grad):
            continue
        leaf.grad = source.grad
        # (A leaf's hook also hears a None its Function returned.)
        leaf.register_hook(lambda grad, k=k: written.returned.add(k) if grad is not None else None)
        written.leaves[k] = (leaf, source)
    return written


class PythonOpExecutor:
    """Claims each python op node; its region is that node and the getitems unpacking its results."""

    name = "python op"
    merges = False

    def claims(self, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and node.target in PYTHON_OPS

    def refusal(self, node: torch.fx.Node) -> str | None:
        return None if self.claims(node) else "not an opaque autograd Function"

    def build(self, region: torch.fx.GraphModule, *, what: str, whole: bool) -> Runner:
        nodes = list(region.graph.nodes)
        placeholders = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
        (op_node,) = (n for n in nodes if self.claims(n))
        is_grad = op_node.target is not python_op
        # The executor holds its Function's record itself, so it outlives the capture's registry
        # entry for as long as a pending backward may need it.
        call = call_of(op_node)
        outputs = region.graph.output_node().args[0]
        if whole:
            raise ValueError("a python op is never a whole graph")
        picks = [int(n.args[1]) for n in outputs]  # type: ignore[union-attr]
        args_template = op_node.args
        made_here = [
            n.name
            for n in nodes
            if n.op == "call_function" and n is not op_node and n.target is not operator.getitem
        ]
        if made_here:
            # A variant without unused output gradients makes their zeros inside the region
            # (runtime/graph_executor.py); this executor runs the op alone, so it is fed zeros.
            raise ValueError(f"a python op region computes only its op, not {made_here}")

        def run(args: list[Any]) -> list[Any]:
            values = map_aggregate(
                args_template, lambda a: args[placeholders[a]] if isinstance(a, torch.fx.Node) else a
            )
            if is_grad:  # (handle, grad_outputs, call_id, sizes)
                result = run_backward(call, values[0], list(values[1]))
            else:  # (inputs, call_id)
                result = run_forward(call, list(values[0]))
            return [result[k] for k in picks]

        run.call = call  # type: ignore[attr-defined]
        run.is_grad = is_grad  # type: ignore[attr-defined]
        return run
