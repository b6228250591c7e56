"""The backward graph in consecutive ONNX Runtime sessions: same gradients, inputs freed early."""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest
import torch
from _parity import assert_same_state, runs_whole_in_onnxruntime, train_side_by_side

from ortrain import ORTModule
from ortrain.capture.backward_segments import backward_segments
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT
from ortrain.ortmodule.options import runtime_options

aten = torch.ops.aten

# The log-probabilities: 2 MiB, above MIN_BYTES_PER_SEGMENT; the logits' zeros are over the size up
# to which the exporter folds a constant into an initializer.
VOCAB, SEQ, BATCH = 512, 64, 16


def _gpt(attention: str = "sdpa", n_layer: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(
        GPTConfig(VOCAB, block_size=SEQ, n_layer=n_layer, n_head=2, d_model=16, attention=attention)
    )


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _unfused_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the loss's log-probabilities in the backward graph (no linear cross-entropy fusion)."""
    monkeypatch.setenv("ORTMODULE_FUSE_LINEAR_CROSS_ENTROPY", "0")


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch, torch.roll(batch, -1, dims=1))[1]


@pytest.mark.parametrize(("segments", "level"), [(4, 0), (4, 1)])
def test_training_matches_eager(monkeypatch: pytest.MonkeyPatch, segments: int, level: int) -> None:
    monkeypatch.setenv("ORTMODULE_BACKWARD_SEGMENTS", str(segments))
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", str(level))  # recompute inside the segments
    torch.manual_seed(2)
    batches = [_batch() for _ in range(3)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(_gpt(), batches, _loss)
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)
    ((entry,),) = wrapped._ortrain_graphs.values()
    backward = entry.capture.backward.runner
    if level == 0:
        assert runs_whole_in_onnxruntime(backward)
        assert 2 <= len(backward.plan.steps) <= segments
        # ``backward(retain_graph=True)`` then ``backward()``: the gradients accumulate twice, as
        # in eager mode, though the segments drop their references to the saved tensors (autograd
        # keeps them for the second run). AOTAutograd refused it ("donated buffers") until wave 12.
        for module in (wrapped, eager):
            module.zero_grad()
            loss = _loss(module, batches[0])
            loss.backward(retain_graph=True)
            loss.backward()
        assert_same_state(wrapped, eager)
        assert all(p.grad is not None for p in wrapped.parameters())
    else:
        # Level 1 leaves gelu_backward to PyTorch (runtime/placement.py): the graph is then cut
        # at those nodes into regions instead of segments, and nothing else leaves ONNX Runtime.
        in_torch = {
            node.target
            for step in backward.plan.steps
            if step.executor.name == "torch"
            for node in step.nodes
            if node.op == "call_function"
        }
        assert in_torch == {aten.gelu_backward.default}


def test_small_graphs_stay_one_session() -> None:
    """Below MIN_BYTES_PER_SEGMENT of inputs freed per segment a cut is not worth a session run."""
    torch.manual_seed(0)
    wrapped = ORTModule(TinyGPT(GPTConfig(64, block_size=16, n_layer=2, n_head=2, d_model=16)))
    _loss(wrapped, torch.randint(0, 64, (4, 16))).backward()
    ((entry,),) = wrapped._ortrain_graphs.values()
    assert entry.capture.backward.runner.plan.whole


def test_saved_tensors_die_after_their_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cut lands where an input of the backward graph is read for the last time, the first
    segment freeing the loss's (rows x vocab) log-probabilities; and nothing between AOTAutograd
    and the plan keeps a saved tensor alive: each one a segment reads last is freed before the
    next segment runs, as eager frees it after its node."""
    monkeypatch.setenv("ORTMODULE_BACKWARD_SEGMENTS", "4")
    _unfused_loss(monkeypatch)
    wrapped = ORTModule(_gpt())
    batch = _batch()
    _loss(wrapped, batch).backward()  # captures
    ((entry,),) = wrapped._ortrain_graphs.values()
    graph = entry.capture.backward.graph.graph
    segments = backward_segments(graph, 4)
    assert len(segments) >= 2
    assert [n for s in segments for n in s] == [
        n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")
    ]
    log_probs = next(n for n in graph.nodes if n.op == "placeholder" and "log_softmax" in n.name)
    assert log_probs.users and all(user in segments[0] for user in log_probs.users)
    assert backward_segments(graph, 1) == [[n for s in segments for n in s]]
    backward = entry.capture.backward.runner
    plan = backward.plan
    assert len(plan.steps) > 1
    # Parameters (primals) live on in the model, and the loss's own gradient in autograd's engine;
    # the saved activations and the logits' tangent have no other owner.
    freed = [
        [
            s
            for s in frees
            if s < plan.num_inputs
            and not plan.placeholders[s].name.startswith("primals")
            and plan.values[s].dim() > 0
        ]
        for frees in plan.frees
    ]
    names = {plan.placeholders[s].name for frees in freed[:-1] for s in frees}
    assert names >= {"_log_softmax", "tangents_1"}
    watched: list[tuple[str, weakref.ref[torch.Tensor]]] = []
    alive: list[str] = []

    def watching(position: int, run: Any) -> Any:
        def step(args: list[Any]) -> list[Any]:
            # A view this segment reads keeps its base alive: that memory is still in use.
            read = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for name, ref in watched:
                tensor = ref()
                if tensor is not None and tensor.untyped_storage().data_ptr() not in read:
                    alive.append(name)
            inputs = plan.steps[position].inputs
            watched.extend(
                (plan.placeholders[s].name, weakref.ref(args[inputs.index(s)])) for s in freed[position]
            )
            return run(args)

        return step

    backward._schedule = [
        (watching(position, run), *rest) for position, (run, *rest) in enumerate(backward._schedule)
    ]
    _loss(wrapped, batch).backward()
    assert len(watched) > len(freed[-1]) and alive == []


def test_bad_segment_count_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_BACKWARD_SEGMENTS", "0")
    with pytest.raises(ValueError, match="ORTMODULE_BACKWARD_SEGMENTS"):
        runtime_options()


def _logits_loss_or_both(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Odd batches train on the loss alone (the logits get no gradient), even ones on both."""
    logits, loss = model(batch, torch.roll(batch, -1, dims=1))
    return loss if int(batch[0, 0]) % 2 else loss + 1e-3 * logits.square().mean()


@pytest.mark.parametrize("segments", [1, 4])
def test_unused_logits_get_no_zeros_gradient(monkeypatch: pytest.MonkeyPatch, segments: int) -> None:
    """The backward graph gets None for the logits' gradient when the loss alone is trained on, and
    the region reading it (cut graphs) or the whole graph (one session) runs without it; gradients
    match eager's either way, also when a later step uses the logits."""
    monkeypatch.setenv("ORTMODULE_BACKWARD_SEGMENTS", str(segments))
    torch.manual_seed(3)
    batches = [_batch() for _ in range(4)]
    batches[0][0, 0], batches[1][0, 0], batches[2][0, 0], batches[3][0, 0] = 1, 2, 3, 4
    model = _gpt()
    wrapped = ORTModule(model)
    wrapped(batches[0], torch.roll(batches[0], -1, dims=1))  # capture, to watch the backward's inputs
    ((entry,),) = wrapped._ortrain_graphs.values()
    slot = entry.capture.backward
    tangent = next(i for i, n in enumerate(slot.graph.graph.nodes) if n.name == "tangents_1")
    handed: list[bool] = []
    run = slot.runner

    def watched(args: list[Any]) -> list[Any]:
        handed.append(args[tangent] is None)
        return run(args)

    slot.runner = watched
    eager = _gpt()
    losses_ort, losses_eager = [], []
    for module, losses in ((wrapped, losses_ort), (eager, losses_eager)):
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        for batch in batches:
            opt.zero_grad()
            loss = _logits_loss_or_both(module, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)
    assert handed == [True, False, True, False]
    variants = run._variants  # type: ignore[attr-defined]
    assert variants and all(v is not None for v in variants.values())

    def products(model: Any) -> list[Any]:
        # (Sums over rows are products with a row of ones, passes/leading_axis_sums.py: not counted.)
        ones = {o for n in model.graph.node if n.op_type == "ConstantOfShape" for o in n.output}
        kinds = {"MatMul", "Gemm", "FusedMatMul"}
        return [n for n in model.graph.node if n.op_type in kinds and not ones & set(n.input)]

    for (index, _), variant in variants.items():
        runner = getattr(variant, "runner", variant)  # a variant whose zero outputs leave as None
        region = runner.exported.model  # the ONNX region without the zero inputs
        step = run.plan.steps[index]  # type: ignore[attr-defined]
        assert len(region.graph.input) < len(step.region.graph.find_nodes(op="placeholder"))
        # Its zeros are made during the run (Expand or ConstantOfShape), not kept as an initializer.
        assert all(math.prod(i.dims) < BATCH * SEQ * VOCAB for i in region.graph.initializer)
        # No product of the zero gradient is left: the head's two matmuls with it are gone.
        original = products(run.runners[index].exported.model)  # type: ignore[attr-defined]
        assert len(products(region)) < len(original) or not original


@pytest.mark.parametrize(("segments", "tuning"), [(1, "0"), (4, "0"), (4, "auto")])
def test_unused_logits_of_a_dynamic_capture_get_no_zeros_gradient(
    monkeypatch: pytest.MonkeyPatch, segments: int, tuning: str
) -> None:
    """With dynamic sizes the logits' missing gradient is None too: the regions reading it (cut
    graphs) or the whole graph (one session) run without it; training matches eager's. With
    automatic op tuning the dynamic graph's first calls run in PyTorch, then ONNX Runtime's
    placement races it: both run the variants. (Attention spelled out: SDPA over open lengths
    keeps PyTorch's kernel, which cuts even a one-session backward.)"""
    monkeypatch.setenv("ORTMODULE_BACKWARD_SEGMENTS", str(segments))
    if tuning == "auto":
        monkeypatch.delenv("ORTMODULE_ENABLE_TUNING")
    torch.manual_seed(5)
    shapes = ((BATCH, SEQ), (24, 48), (8, 40))  # the dynamic graph: both, then the loss alone
    batches = [torch.randint(0, VOCAB, shape) for shape in shapes]
    for i, batch in enumerate(batches):
        batch[0, 0] = i + 1  # odd: the loss alone; even: the logits too (_logits_loss_or_both)
    # One layer: a dynamic capture costs four static ones, and a second layer adds nothing here.
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        _gpt("softmax", n_layer=1), batches, _logits_loss_or_both
    )
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)
    (dynamic,) = [e for group in wrapped._ortrain_graphs.values() for e in group if e.capture.dynamic_dims]
    if tuning == "auto":
        return
    # Symbolic sizes cross the sessions' boundaries: the dynamic capture's backward is cut too.
    assert len(dynamic.capture.backward.runner.plan.steps) > 1 or segments == 1
    variants = dynamic.capture.backward.runner._variants
    assert variants and all(v is not None for v in variants.values())
