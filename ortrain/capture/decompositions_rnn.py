"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) unrolled while capturing, above autograd.

``torch.lstm`` and its kin are composite: on the CPU they run as ``mkldnn_rnn_layer`` (and its
backward), which has no ONNX translation and, run in PyTorch between ONNX Runtime regions, returns
an undefined workspace that AOTAutograd refuses as a saved tensor ("expected all
tensors_saved_with_vc_check to be Tensors"): an LSTM fell back to PyTorch as a whole. PyTorch's
own decompositions of these ops (``torch._decomp``: one step per time step, matrix products and
gates) are swapped in above autograd (see :mod:`ortrain.capture.function_overrides`); autograd
differentiates them into ops that export. Packed sequences (the ``.data`` overloads) included.
The unrolled graph holds one step per time step: a new sequence length captures again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import decomposition_table

aten = torch.ops.aten

_OPS = {
    torch.lstm: (aten.lstm.input, aten.lstm.data),
    torch.gru: (aten.gru.input, aten.gru.data),
    torch.rnn_tanh: (aten.rnn_tanh.input, aten.rnn_tanh.data),
    torch.rnn_relu: (aten.rnn_relu.input, aten.rnn_relu.data),
}


def _unrolled(padded: Any, packed: Any) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        # (input, hx, params, ...) or, packed, (data, batch_sizes, hx, params, ...): the
        # parameters' list comes one place later.
        packed_form = len(args) > 3 and isinstance(args[3], (list, tuple))
        # The LSTM decomposition itself picks mkldnn_rnn_layer where oneDNN is on: turned off,
        # it unrolls in plain ops.
        # (torch.backends.mkldnn.flags would also set TF32 and warn about Intel GPUs.)
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return decomposition_table[packed if packed_form else padded](*args, **kwargs)
        finally:
            torch._C._set_mkldnn_enabled(enabled)

    return call


def recurrent_overrides() -> dict[Callable[..., Any], Callable[..., Any]]:
    return {function: _unrolled(*ops) for function, ops in _OPS.items()}
