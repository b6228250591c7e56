"""The backward graph in consecutive ONNX Runtime sessions: same gradients, inputs freed early."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from _parity import assert_same_state, runs_whole_in_onnxruntime, train_side_by_side

from ortrain import ORTModule
from ortrain.capture.backward_segments import backward_segments
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT
from ortrain.ortmodule.options import runtime_options

VOCAB, SEQ, BATCH = 512, 64, 8  # the log-probabilities: 1 MiB, above MIN_BYTES_PER_SEGMENT


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(VOCAB, block_size=SEQ, n_layer=2, n_head=2, d_model=16))


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch, torch.roll(batch, -1, dims=1))[1]


@pytest.mark.parametrize("segments", [1, 4])
def test_training_matches_eager(monkeypatch: pytest.MonkeyPatch, segments: int) -> None:
    monkeypatch.setenv("ORTMODULE_BACKWARD_SEGMENTS", str(segments))
    torch.manual_seed(2)
    batches = [_batch() for _ in range(3)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(_gpt(), batches, _loss)
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)
    ((entry,),) = wrapped._ortrain_graphs.values()
    backward = entry.capture.backward.runner
    assert runs_whole_in_onnxruntime(backward)
    assert len(backward.plan.steps) == 1 if segments == 1 else 2 <= len(backward.plan.steps) <= segments


def test_cuts_follow_the_bytes_freed() -> None:
    """Each cut lands where an input of the backward graph is read for the last time, and the
    first segment frees the loss's (rows x vocab) log-probabilities."""
    wrapped = ORTModule(_gpt())
    batch = _batch()
    _loss(wrapped, batch).backward()
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


def test_small_graphs_stay_one_session() -> None:
    """Below MIN_BYTES_PER_SEGMENT of inputs freed per segment a cut is not worth a session run."""
    torch.manual_seed(0)
    wrapped = ORTModule(TinyGPT(GPTConfig(64, block_size=16, n_layer=2, n_head=2, d_model=16)))
    _loss(wrapped, torch.randint(0, 64, (4, 16))).backward()
    ((entry,),) = wrapped._ortrain_graphs.values()
    assert entry.capture.backward.runner.plan.whole


def test_saved_tensors_die_after_their_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing between AOTAutograd and the plan keeps a saved tensor alive: each one a segment reads
    last is freed before the next segment runs, as eager frees it after its node."""
    monkeypatch.setenv("ORTMODULE_BACKWARD_SEGMENTS", "4")
    wrapped = ORTModule(_gpt())
    batch = _batch()
    _loss(wrapped, batch).backward()  # captures
    ((entry,),) = wrapped._ortrain_graphs.values()
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
