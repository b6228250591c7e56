"""Train a model under ORTModule and in eager PyTorch from the same start, and compare."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ortrain import ORTModule
from ortrain.runtime.executors.ort import OnnxRuntimeExecutor
from ortrain.runtime.graph_executor import PlanRunner
from ortrain.runtime.torch_native_ops import FUSED_ATTENTION


def runs_whole_in_onnxruntime(runner: object) -> bool:
    """ONNX Runtime runs the whole captured graph: one session (the fast path), or for a backward
    graph consecutive sessions (ORTMODULE_BACKWARD_SEGMENTS) with no PyTorch work between them."""
    if not isinstance(runner, PlanRunner):
        return False
    return all(isinstance(step.executor, OnnxRuntimeExecutor) for step in runner.plan.steps)


def runs_in_onnxruntime_but_attention(runner: object) -> bool:
    """ONNX Runtime runs the whole captured graph but its attention kernels, which PyTorch runs
    by design where the graph leaves its sequence lengths open (ortrain.runtime.torch_native_ops)."""
    if not isinstance(runner, PlanRunner):
        return False
    for step in runner.plan.steps:
        if isinstance(step.executor, OnnxRuntimeExecutor):
            continue
        targets = {getattr(n.target, "overloadpacket", n.target) for n in step.nodes}
        if not targets <= FUSED_ATTENTION | {operator.getitem}:
            return False
    return True


def ort_graph_count(model: ORTModule) -> int:
    """How many captures ran on ONNX Runtime (each with a forward and maybe a backward graph)."""
    count = 0
    for entries in model._ortrain_graphs.values():
        for entry in entries:
            assert runs_in_onnxruntime_but_attention(entry.capture.forward.runner)
            if entry.capture.backward is not None:
                assert runs_in_onnxruntime_but_attention(entry.capture.backward.runner)
            count += 1
    return count


def train_side_by_side(
    model: torch.nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    lr: float = 0.05,
) -> tuple[list[float], list[float], torch.nn.Module, ORTModule]:
    """Run ``len(batches)`` SGD steps on an ORTModule copy and an eager copy; return both losses."""
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    opt_ort = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=lr, momentum=0.9)
    losses_ort, losses_eager = [], []
    for batch in batches:
        for module, opt, losses in ((wrapped, opt_ort, losses_ort), (eager, opt_eager, losses_eager)):
            opt.zero_grad()
            loss = loss_fn(module, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses_ort, losses_eager, eager, wrapped


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module, *, atol: float = 1e-4) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        va, vb = sa[key], sb[key]
        if va.dtype.is_floating_point:
            torch.testing.assert_close(va, vb, rtol=1e-4, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert torch.equal(va, vb), key


def capture_reasons_across(
    model: torch.nn.Module,
    change: Callable[[torch.nn.Module, torch.nn.Module], None],
    caplog: Any,
    *,
    calls_after: int = 2,
    rel: float = 1e-6,
) -> list[str]:
    """``model`` and an ORTModule of a copy of it give the same loss on one input (seed 0) before
    and after ``change(model, the copy)``, ``calls_after`` calls after it; returns why each
    capture happened (the ``capturing a graph: ...`` lines). ``caplog``: pytest's fixture."""
    import logging

    import pytest

    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="ortrain"):
        assert wrapped(x).item() == pytest.approx(model(x).item(), rel=rel)
        change(model, wrapped.module)
        for _ in range(calls_after):
            assert wrapped(x).item() == pytest.approx(model(x).item(), rel=rel)
    messages = (r.getMessage() for r in caplog.records)
    return [m for m in messages if m.startswith("capturing a graph:")]


def calls_agree(model: torch.nn.Module, state: Callable[[Any], Any], calls: int = 4) -> None:
    """``calls`` calls of ``model`` and of an ORTModule copy agree on one input (seed 0), and leave
    the same ``state`` (what a forward counting its calls counted)."""
    import pytest

    torch.manual_seed(0)
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(3, 4)
    for _ in range(calls):
        assert wrapped(x).item() == pytest.approx(model(x).item(), rel=1e-5)
    assert state(wrapped.module) == state(model)
