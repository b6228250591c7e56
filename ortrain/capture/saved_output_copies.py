"""A returned output that shares memory with a tensor the backward saved is handed over as a copy.

A forward returning a view of an intermediate its backward saves (``h = tanh(...)``, whose
backward reads ``h``; ``return loss, h[:, :2]``) gets that view from the graph's runner as a view
of the saved tensor (ONNX Runtime's runner makes views of its outputs from the first capture with
open sizes on; PyTorch's executor runs the slice itself). AOTAutograd hands it to the user as an
output of its own, with a version counter of its own: a write into it (``v.mul_(3)``), which eager
refuses at the backward ("modified by an inplace operation"), went unseen, and the backward read
the written values (wave 47's review: bias gradients of -19.4 where the unwritten ones are 4.95,
silently, from the second batch size on). Handed over as a copy, the output is what the first,
fixed-size capture gave and what ``torch.compile`` gives: a write into it changes no gradient.
An output that *is* a saved tensor (``return loss, h``) shares the saved tensor's version
counter, and a write into it is refused as eager refuses it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch._aot_autograd.schemas import OutputType

# Outputs AOTAutograd hands over as the graph returned them (other kinds it remakes as views).
_AS_RETURNED = (OutputType.non_alias, OutputType.unsafe_view_alias)


class SavedOutputs:
    """Which of a compiled forward's outputs are the user's, handed over as returned, and where the
    user's outputs end (after them: intermediate bases and the tensors saved for backward)."""

    def __init__(self, metadata: Any) -> None:
        first = metadata.num_mutated_inp_runtime_indices  # mutated inputs' new values come first
        self.positions = tuple(
            first + i for i, info in enumerate(metadata.output_info) if info.output_type in _AS_RETURNED
        )
        self.end = first + len(metadata.output_info)

    def copy_shared(self, outputs: list[Any]) -> None:
        """Replace, in ``outputs``, each such output that is a view sharing memory with a later
        output (a saved tensor) by a copy."""
        views = [p for p in self.positions if isinstance(outputs[p], torch.Tensor) and outputs[p]._is_view()]
        if not views:
            return
        saved = {
            t.untyped_storage().data_ptr()
            for t in outputs[self.end :]
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel()
        }
        for p in views:
            output = outputs[p]
            if output.numel() and output.untyped_storage().data_ptr() in saved:
                outputs[p] = output.clone(memory_format=torch.preserve_format)
