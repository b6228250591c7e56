"""Train a model under ``torch.compile(backend=ortrain)`` and in eager PyTorch from the same start."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from functorch.compile import nop
from torch._dynamo.backends.common import aot_autograd

from ortrain.backend import OrtrainBackend


def count_dynamo_graphs(
    model: torch.nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    lr: float = 0.05,
) -> int:
    """How many graphs Dynamo + AOTAutograd split a model into over the same training (counted).

    The steps are the same as in the side-by-side runs: values decide the branches and guards.
    """
    graphs = 0

    def counting(gm: torch.fx.GraphModule, example: Any) -> Any:
        nonlocal graphs
        graphs += 1
        # Through AOTAutograd as any training backend: its tracing can ask Dynamo to specialize
        # (a float that became symbolic, say) and so compile a frame once more.
        return aot_autograd(fw_compiler=nop)(gm, example)

    torch._dynamo.reset()
    copied = copy.deepcopy(model)
    compiled = torch.compile(copied, backend=counting)
    opt = torch.optim.SGD(copied.parameters(), lr=lr, momentum=0.9)
    for batch in batches:
        opt.zero_grad()
        loss_fn(compiled, batch).backward()
        opt.step()
    torch._dynamo.reset()
    return graphs


def train_compiled_side_by_side(
    model: torch.nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    lr: float = 0.05,
) -> tuple[list[float], list[float], torch.nn.Module, OrtrainBackend]:
    """SGD steps on a ``torch.compile(backend=ortrain)`` copy and an eager copy; returns both losses."""
    torch._dynamo.reset()
    eager = copy.deepcopy(model)
    backend = OrtrainBackend()
    compiled = torch.compile(model, backend=backend)
    opt_ort = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=lr, momentum=0.9)
    losses_ort: list[float] = []
    losses_eager: list[float] = []
    for batch in batches:
        for module, opt, losses in ((compiled, opt_ort, losses_ort), (eager, opt_eager, losses_eager)):
            opt.zero_grad()
            loss = loss_fn(module, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch._dynamo.reset()
    return losses_ort, losses_eager, eager, backend
