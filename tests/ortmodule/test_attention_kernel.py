"""Attention is captured as PyTorch's flash kernel; large calls run it in PyTorch, small ones run
in ONNX Runtime written out in math (ortrain.export.flash_attention_math); either way losses and
gradients equal eager's."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from _parity import assert_same_state, runs_whole_in_onnxruntime, train_side_by_side
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import ortrain.runtime.torch_native_ops as torch_native_ops
from ortrain import ORTModule
from ortrain.capture.attention_kernel import probability_bytes

aten = torch.ops.aten
FLASH_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class Attention(nn.Module):
    def __init__(
        self, d_model: int = 32, heads: int = 4, kv_heads: int | None = None, **sdpa: object
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head = d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * self.kv_heads * self.head)
        self.out = nn.Linear(d_model, d_model)
        self.sdpa = sdpa

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head).permute(2, 0, 3, 1, 4)
        extra = dict(self.sdpa)
        if mask is not None:
            extra["attn_mask"] = mask
        if self.kv_heads != self.heads:
            extra["enable_gqa"] = True
        y = F.scaled_dot_product_attention(q, k, v, **extra)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, mask = batch
    return model(x, mask).pow(2).mean()


def _batches(t: int = 24, *, mask: str | None = None, steps: int = 3) -> list[tuple]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randn(2, t, 32, generator=generator)
        if mask == "padding":  # the second sequence ends in 7 pad positions, as HF's masks say
            keep = torch.ones(2, 1, 1, t, dtype=torch.bool)
            keep[1, ..., t - 7 :] = False
            out.append((x, keep))
        elif mask == "additive":
            out.append((x, torch.randn(2, 1, t, t, generator=generator)))
        else:
            out.append((x, None))
    return out


def _ops(wrapped: ORTModule) -> tuple[dict[str, list[object]], dict[str, list[object]]]:
    """Executor name -> operators it runs, for the forward and the backward graph."""
    (entry,) = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    graphs = []
    for runner in (entry.capture.forward.runner, entry.capture.backward.runner):
        by_executor: dict[str, list[object]] = {}
        for step in runner.plan.steps:
            ops = [n.target for n in step.nodes if n.target is not operator.getitem]
            by_executor.setdefault(step.executor.name, []).extend(ops)
        graphs.append(by_executor)
    return graphs[0], graphs[1]


@pytest.fixture
def flash_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's kernel for every size: the tests' attention is small, the rule is about size alone."""
    monkeypatch.setattr(torch_native_ops, "FLASH_MIN_PROBABILITY_BYTES", 0)


def test_probability_bytes_counts_batch_heads_and_both_lengths() -> None:
    query, key = torch.empty(2, 4, 10, 8), torch.empty(2, 4, 12, 8)
    assert probability_bytes(query, key) == 2 * 4 * 10 * 12 * 4
    assert probability_bytes(query.half(), key.half()) == 2 * 4 * 10 * 12 * 2


def _captured_ops(wrapped: ORTModule) -> tuple[set[object], set[object]]:
    (entry,) = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    return (
        {n.target for n in entry.capture.forward.graph.graph.nodes},
        {n.target for n in entry.capture.backward.graph.graph.nodes},
    )


def test_small_attention_is_captured_as_flash_and_runs_whole_in_onnxruntime() -> None:
    """Captured as eager's kernel (what PyTorch runs if the tuner gives it the graph), exported in
    its math form: no crossing between the libraries."""
    wrapped = ORTModule(Attention(is_causal=True))
    _loss(wrapped, _batches()[0]).backward()
    forward, backward = _captured_ops(wrapped)
    assert FLASH_FORWARD in forward and FLASH_BACKWARD in backward
    assert aten._safe_softmax.default not in forward
    (entry,) = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    assert runs_whole_in_onnxruntime(entry.capture.forward.runner)
    assert runs_whole_in_onnxruntime(entry.capture.backward.runner)


def test_attention_at_the_threshold_runs_the_kernel_in_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    # batch 2 x heads 4 x 24 x 24 float32 probabilities: 18432 bytes.
    monkeypatch.setattr(torch_native_ops, "FLASH_MIN_PROBABILITY_BYTES", 18432)
    wrapped = ORTModule(Attention(is_causal=True))
    _loss(wrapped, _batches()[0]).backward()
    forward, backward = _ops(wrapped)
    assert forward["torch"] == [FLASH_FORWARD]
    assert backward["torch"] == [FLASH_BACKWARD]
    monkeypatch.setattr(torch_native_ops, "FLASH_MIN_PROBABILITY_BYTES", 18433)
    wrapped = ORTModule(Attention(is_causal=True))
    _loss(wrapped, _batches()[0]).backward()
    forward, backward = _ops(wrapped)
    assert "torch" not in forward and "torch" not in backward


@pytest.mark.usefixtures("flash_always")
@pytest.mark.parametrize(
    ("sdpa", "mask", "kv_heads"),
    [
        ({"is_causal": True}, None, None),
        ({}, "padding", None),
        ({}, "additive", None),
        ({"is_causal": True, "scale": 0.3}, None, None),
        ({"is_causal": True}, None, 2),
    ],
    ids=["causal", "padding-mask", "additive-mask", "scale", "grouped-query"],
)
def test_flash_attention_trains_like_eager(sdpa: dict, mask: str | None, kv_heads: int | None) -> None:
    torch.manual_seed(0)
    model = Attention(kv_heads=kv_heads, **sdpa)
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, _batches(mask=mask), _loss)
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped.module, eager, atol=1e-5)
    forward, backward = _ops(wrapped)
    assert FLASH_FORWARD in forward["torch"] and FLASH_BACKWARD in backward["torch"]


@pytest.mark.parametrize(
    ("sdpa", "mask"),
    [
        ({"is_causal": True}, None),
        ({}, "padding"),
        ({}, "additive"),
        ({"is_causal": True, "scale": 0.3}, None),
    ],
    ids=["causal", "padding-mask", "additive-mask", "scale"],
)
def test_math_form_in_onnxruntime_trains_like_eager(sdpa: dict, mask: str | None) -> None:
    """Small attention: the flash nodes run in ONNX Runtime as math, against eager's kernel."""
    torch.manual_seed(0)
    model = Attention(**sdpa)
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, _batches(mask=mask), _loss)
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped.module, eager, atol=1e-5)
    forward, backward = _ops(wrapped)
    assert FLASH_FORWARD in forward["onnxruntime"] and FLASH_BACKWARD in backward["onnxruntime"]
    assert "torch" not in forward and "torch" not in backward


@pytest.mark.usefixtures("flash_always")
def test_flash_attention_gradients_match_the_math_form_exactly_enough() -> None:
    """Against eager's math kernel too: eager would pick flash itself, so parity with eager alone
    could not see a flash-specific mistake."""
    torch.manual_seed(0)
    model = Attention(is_causal=True)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x, _ = _batches()[0]
    _loss(wrapped, (x, None)).backward()
    with sdpa_kernel(SDPBackend.MATH):
        _loss(reference, (x, None)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.usefixtures("flash_always")
def test_learned_attention_bias_gets_its_gradient() -> None:
    """Flash's backward returns no gradient for the mask: a bias that needs one takes the math form."""

    class LearnedBias(Attention):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(1, 1, 24, 24) * 0.1)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return super().forward(x, self.bias)

    torch.manual_seed(0)
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(LearnedBias(), _batches(), _loss)
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped.module, eager, atol=1e-5)
    assert wrapped.module.bias.grad is not None and wrapped.module.bias.grad.abs().sum() > 0


@pytest.mark.usefixtures("flash_always")
def test_flash_attention_with_dropout_takes_the_math_form() -> None:
    # PyTorch's CPU flash kernel has no dropout: the dispatcher falls back to the math form.
    wrapped = ORTModule(Attention(is_causal=True, dropout_p=0.1))
    _loss(wrapped, _batches()[0]).backward()
    forward, _ = _ops(wrapped)
    assert FLASH_FORWARD not in forward.get("torch", [])


def _trained_across_lengths(lengths: tuple[int, ...]) -> tuple[Attention, ORTModule]:
    """Causal attention trained a step at each length beside eager, its gradients checked."""
    torch.manual_seed(0)
    model = Attention(is_causal=True)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for t in lengths:
        x = torch.randn(2, t, 32)
        for module in (wrapped, eager):
            module.zero_grad()
            _loss(module, (x, None)).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    return eager, wrapped


@pytest.mark.usefixtures("flash_always")
def test_flash_attention_across_sequence_lengths_and_in_eval() -> None:
    """A new length re-captures with symbolic sizes; eval mode runs the forward alone."""
    eager, wrapped = _trained_across_lengths((24, 40, 17))
    wrapped.eval()
    eager.eval()
    x = torch.randn(3, 30, 32)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("flash_always")
def test_flash_attention_model_changed_while_training() -> None:
    """Frozen then unfrozen projection, then a swapped output layer: each change re-captures (or is
    guarded) and gradients stay eager's, with flash attention in the graphs."""
    torch.manual_seed(0)
    model = Attention(is_causal=True)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    batches = _batches(steps=4)

    def change(module: Attention, step: int) -> None:
        if step == 0:
            module.q.weight.requires_grad_(False)
        elif step == 1:
            module.q.weight.requires_grad_(True)
        elif step == 2:
            torch.manual_seed(7)
            module.out = nn.Linear(32, 32)

    for step, batch in enumerate(batches):
        for module, target in ((wrapped, model), (eager, eager)):
            change(target, step)
            target.zero_grad(set_to_none=True)
            _loss(module, batch).backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, f"step {step}: {name} has a gradient eager does not"
            else:
                where = f"step {step}: {name}"
                torch.testing.assert_close(
                    p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
                )
    entries = [e for es in wrapped._ortrain_graphs.values() for e in es]
    assert len(entries) >= 2  # the requires-grad change and the new layer re-captured
    for entry in entries:
        ops = [n.target for step in entry.capture.forward.runner.plan.steps for n in step.nodes]
        assert FLASH_FORWARD in ops


class _MaskedAttentionReshaped(nn.Module):
    """Attention under a padding mask, its heads merged by ``transpose(1, 2).reshape``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, 4, 8).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        allowed = mask[:, None, None, :].bool() | torch.eye(t, dtype=torch.bool)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(y.transpose(1, 2).reshape(b, t, c)).square().mean()


def test_masked_attention_with_heads_merged_by_reshape_exports_at_new_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The merged heads are a view where the capture's strides allow one: the export's re-trace at
    a new size saw other strides and failed ("Cannot view a tensor with shape [s20, 9, 4, 8]"), and
    until wave 43 the region ran in PyTorch (refused under FALLBACK_DISABLE)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = _MaskedAttentionReshaped()
    wrapped = ORTModule(copy.deepcopy(model))
    for b, t in [(4, 12), (3, 9), (5, 16)]:
        x, mask = torch.randn(b, t, 32), (torch.rand(b, t) > 0.3).long()
        losses = [m(x, mask) for m in (model, wrapped)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0])
        torch.testing.assert_close(wrapped.qkv.weight.grad, model.qkv.weight.grad)


def test_small_attention_over_open_lengths_keeps_the_kernel_in_pytorch() -> None:
    """Captured again at a new length, the graph serves every length: its next call may be far
    longer than the one traced, where the math form's probabilities (length squared) cost seconds
    and GiB a step (wave 49's review: 4096 after 64-96). The first, static graph keeps its small
    attention in ONNX Runtime."""
    _, wrapped = _trained_across_lengths((24, 40, 96))
    static, open_lengths = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    for entry, kernel_in_pytorch in ((static, False), (open_lengths, True)):
        for runner, kernel in (
            (entry.capture.forward.runner, FLASH_FORWARD),
            (entry.capture.backward.runner, FLASH_BACKWARD),
        ):
            in_pytorch = [n.target for s in runner.plan.steps if s.executor.name == "torch" for n in s.nodes]
            assert (kernel in in_pytorch) is kernel_in_pytorch
