"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as one opaque op run by PyTorch's kernel.

Unrolled into plain ops (:mod:`ortrain.capture.decompositions_rnn`) a recurrent layer becomes one
graph step per time step: the loop fixes the sequence length, so every new length captured again
(≈ 30 s for a 2-layer LSTM over 64 steps on a 2-core machine, and the least recently used graph
evicted past eight lengths), and the many small nodes ran 2.7× slower than eager's fused oneDNN
kernel. Here each ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` call over a padded
batch becomes a python op (:mod:`ortrain.capture.python_ops`) whose Function runs the same
``torch`` function with autograd at run time, so a captured graph holds for every sequence length
and the layer costs what it costs eagerly, dropout between layers drawn from PyTorch's generator
as in eager mode.

While capturing, the Function's forward and backward see fake tensors and only state shapes: the
native kernels cannot run on symbolic sizes ("Cannot call numel() on tensor with symbolic
sizes"), and their output shapes follow from the inputs' (the features of the output are the
directions times the hidden state's). Packed sequences (the ``.data`` overloads), and every
layer when Functions are traced rather than opaque (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0``), are
unrolled as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from ortrain.capture.function_calls import apply_as_python_op
from ortrain.capture.graph_task import backward_keeps_graph
from ortrain.capture.python_ops import interception_enabled


@dataclass(frozen=True)
class LayerOptions:
    """The non-tensor arguments of ``torch.lstm(input, hx, params, ...)`` and its kin."""

    hidden_states: int  # 2 for an LSTM (h, c), 1 otherwise
    has_biases: bool
    num_layers: int
    dropout: float
    train: bool
    bidirectional: bool
    batch_first: bool


class RecurrentLayer(torch.autograd.Function):
    """``function(input, hx, params, *options)`` with autograd kept inside, as one opaque op.

    Arguments of ``apply``: the options, the input, the hidden states, then the parameters.
    Returns the output and the final hidden states.
    """

    function: Callable[..., Any]

    @classmethod
    def forward(cls, ctx: Any, options: LayerOptions, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        needs = ctx.needs_input_grad[1:]
        if any(is_fake(t) for t in tensors):
            ctx.shapes_only = True
            ctx.leaves = [t for t, need in zip(tensors, needs, strict=True) if need]
            return cls._shapes(options, tensors)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs, strict=True)]
            outputs = cls._call(options, leaves)
        ctx.shapes_only = False
        ctx.leaves = [leaf for leaf, need in zip(leaves, needs, strict=True) if need]
        ctx.outputs = outputs
        return tuple(o.detach() for o in outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        leaves: list[torch.Tensor] = ctx.leaves
        computed: list[torch.Tensor | None]
        if ctx.shapes_only:
            computed = [torch.empty_like(leaf) for leaf in leaves]
            return RecurrentLayer._per_input(ctx, computed)
        if ctx.outputs is None:
            raise RuntimeError(
                "a recurrent layer's backward ran twice: its graph goes after one backward; specify "
                "retain_graph=True on the first backward to run it again"
            )
        keep = backward_keeps_graph()
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads, strict=True) if g is not None]
        if pairs and leaves:
            computed = list(
                torch.autograd.grad(
                    [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True, retain_graph=keep
                )
            )
        else:
            computed = [None] * len(leaves)
        if not keep:
            ctx.outputs = None  # the graph goes after one backward, as with retain_graph=False
        return RecurrentLayer._per_input(ctx, computed)

    @staticmethod
    def _per_input(ctx: Any, computed: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        given = iter(computed)
        return (None, *(next(given) if need else None for need in ctx.needs_input_grad[1:]))

    @classmethod
    def _call(cls, options: LayerOptions, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        count = options.hidden_states
        input, hx, params = tensors[0], tensors[1 : 1 + count], tensors[1 + count :]
        result = cls.function(
            input,
            tuple(hx) if count > 1 else hx[0],
            params,
            options.has_biases,
            options.num_layers,
            options.dropout,
            options.train,
            options.bidirectional,
            options.batch_first,
        )
        return tuple(result)

    @classmethod
    def _shapes(cls, options: LayerOptions, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if interception_enabled():
            # Only the python op's shape run may see fake tensors; traced inline, these empty
            # outputs would become the graph.
            raise RuntimeError(f"{cls.__qualname__} must run as an ortrain python op while capturing")
        input, hx = tensors[0], tensors[1 : 1 + options.hidden_states]
        directions = 2 if options.bidirectional else 1
        # (seq, batch, features), or (batch, seq, features) with batch_first: only features change.
        shape = (*input.shape[:2], directions * hx[0].shape[-1])
        # The state each hidden state was given, updated: same shape.
        return (input.new_empty(shape), *(h.new_empty(h.shape) for h in hx))


class LSTM(RecurrentLayer):
    function = staticmethod(torch.lstm)


class GRU(RecurrentLayer):
    function = staticmethod(torch.gru)


class RNNTanh(RecurrentLayer):
    function = staticmethod(torch.rnn_tanh)


class RNNReLU(RecurrentLayer):
    function = staticmethod(torch.rnn_relu)


_LAYERS: dict[Callable[..., Any], type[RecurrentLayer]] = {
    torch.lstm: LSTM,
    torch.gru: GRU,
    torch.rnn_tanh: RNNTanh,
    torch.rnn_relu: RNNReLU,
}


def _as_python_op(layer: type[RecurrentLayer], unrolled: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        # (input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
        # the packed form has the batch sizes second and no batch_first.
        if kwargs or len(args) != 9 or not isinstance(args[2], (list, tuple)):
            return unrolled(*args, **kwargs)
        input, hx, params, *flags = args
        states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        options = LayerOptions(len(states), *flags)
        return apply_as_python_op(layer, (options, input, *states, *params), {})

    return call


Overrides = dict[Callable[..., Any], Callable[..., Any]]


def recurrent_python_ops(unrolled: Overrides) -> Overrides:
    """Overrides (see :mod:`ortrain.capture.function_overrides`) that make each recurrent call a
    python op, handing the packed form to ``unrolled``'s entry for the same function."""
    return {function: _as_python_op(layer, unrolled[function]) for function, layer in _LAYERS.items()}
