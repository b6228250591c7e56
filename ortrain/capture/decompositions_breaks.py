"""Decompositions for ops that real models emit under tracing and that have no ONNX translation.

Kept apart from :mod:`ortrain.capture.decompositions` and merged into its table. Each entry is
here for a measured reason:

- ``transformers::grouped_mm_fallback`` and its backward: Hugging Face mixture-of-experts layers
  (Mixtral, Qwen-MoE, OLMoE, ...) run experts as one grouped matmul over token rows sorted by
  expert, ``offs`` holding each expert's end row. When traced (``torch.compiler.is_compiling()``,
  which ortrain's capture reports) on a dtype other than bfloat16 they call this custom op, whose
  eager kernel loops over ``offs.tolist()``. Written here without data-dependent sizes: each row's
  expert is the number of ends at or before it, and every expert's product is computed for every
  row and the row's own selected by a one-hot mask. Exact, at ``num_experts`` times the matmul
  work of the loop (fine for the small expert counts of CPU training; a torch executor that runs
  the op itself is the better answer for large ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _expert_one_hot(rows: int, offs: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, experts): 1 where a row belongs to that expert; rows past the last end belong to none."""
    row = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    expert = (row.unsqueeze(1) >= offs.unsqueeze(0)).sum(1)  # ends at or before the row
    return (expert.unsqueeze(1) == torch.arange(experts, device=offs.device)).to(dtype)


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = input[r] @ weight[expert(r)]``; zero for rows past ``offs[-1]``."""
    one_hot = _expert_one_hot(input.shape[0], offs, weight.shape[0], input.dtype)
    every = torch.einsum("sk,ekn->sen", input, weight)
    return (every * one_hot.unsqueeze(2)).sum(1)


def grouped_mm_backward(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    one_hot = _expert_one_hot(input.shape[0], offs, weight.shape[0], input.dtype)
    grad_every = torch.einsum("sn,ekn->sek", grad_output, weight)
    grad_input = (grad_every * one_hot.unsqueeze(2)).sum(1)
    grad_weight = torch.einsum("se,sk,sn->ekn", one_hot, input, grad_output)
    return grad_input, grad_weight


def _custom_op(namespace: str, name: str) -> Any:
    """The op's default overload if the library that defines it has been imported, else None."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def break_decompositions() -> dict[Any, Callable[..., Any]]:
    """Entries for the capture's decomposition table (looked up at each capture: libraries load late)."""
    table: dict[Any, Callable[..., Any]] = {}
    forward = _custom_op("transformers", "grouped_mm_fallback")
    if forward is not None:
        table[forward] = grouped_mm
    backward = _custom_op("transformers", "grouped_mm_fallback_backward")
    if backward is not None:
        table[backward] = grouped_mm_backward
    return table
