"""Mixture-of-experts layers with top-k routing and per-expert matmuls train with eager parity."""

from __future__ import annotations

import logging
import time
import warnings

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.errors import ORTModuleTorchModelException

STEPS = 3


class TopKMoE(nn.Module):
    """Eager-style routing, as research code writes it: ``torch.where`` per expert (data-dependent)."""

    def __init__(self, d: int = 8, hidden: int = 12, experts: int = 3, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, hidden) * 0.3)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = F.softmax(self.router(x), dim=-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            token, slot = torch.where(chosen == e)
            h = F.gelu(x[token] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, token, h * weights[token, slot, None])
        return out


def test_top_k_moe_with_data_dependent_dispatch_trains_with_parity(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TorchDynamo cannot resume after the value-sized ``torch.where``: it gives the whole forward up
    to eager PyTorch. Wave 48's review: that was an INFO line, under FALLBACK_DISABLE too; now it is
    one warning by default, as any code that trains in PyTorch."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    batches = [(torch.randn(10, 8), torch.randn(10, 8)) for _ in range(STEPS)]
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        losses_ort, losses_eager, eager, wrapped = train_side_by_side(
            TopKMoE(), batches, lambda m, b: F.mse_loss(m(b[0]), b[1])
        )
    torch._dynamo.reset()
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=1e-6)
    assert_same_state(wrapped, eager)
    assert wrapped._ortrain_graph_breaks is not None  # torch.where per expert: graph breaks
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "the whole function runs in eager PyTorch" in warned[0], warned


def test_a_forward_torchdynamo_gives_up_is_refused_under_fallback_disable() -> None:
    torch.manual_seed(0)
    wrapped = ORTModule(TopKMoE())
    with pytest.raises(ORTModuleTorchModelException, match="the whole function runs in eager PyTorch"):
        wrapped(torch.randn(10, 8))
    torch._dynamo.reset()


def test_hf_mixtral_grouped_experts_train_on_the_whole_graph_path() -> None:
    # Traced, transformers' experts pick the kernel meant for compilation; before ortrain reported
    # is_compiling() its capture failed with "Expected inputs of BF16 type" for a float32 model.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    batches = [torch.randint(0, 64, (2, 8)) for _ in range(STEPS)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        model, batches, lambda m, b: m(input_ids=b, labels=b).loss
    )
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=0)
    assert_same_state(wrapped, eager)
    assert wrapped._ortrain_graph_breaks is None
    assert ort_graph_count(wrapped) == 1


NOTES = "print"
_notes_log = logging.getLogger("user")


def _notes(items: list[str]) -> None:
    for item in items:  # no tensor work: TorchDynamo gives this helper up, which costs nothing
        if NOTES == "print":
            print("note", item)
        elif NOTES == "time":
            time.perf_counter()
        elif NOTES == "warn":
            warnings.warn(f"note {item}", stacklevel=1)
        elif NOTES == "log":
            _notes_log.warning("note %s", item)
        elif NOTES == "break":
            torch._dynamo.graph_break()


class _Noted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.sum().item() > 100:  # data-dependent: the graph-break path
            h = h * 2
        _notes(["a", "b"])
        return self.b(h).pow(2).sum()


def test_a_helper_torchdynamo_gives_up_is_not_an_eager_region(caplog: pytest.LogCaptureFixture) -> None:
    """The review of wave 48's diff: a skipped helper that only prints was refused under
    FALLBACK_DISABLE (as here) as if the model's tensor work ran in PyTorch."""
    torch.manual_seed(0)
    batches = [(torch.randn(3, 4),) for _ in range(STEPS)]
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        losses_ort, losses_eager, _, wrapped = train_side_by_side(_Noted(), batches, lambda m, b: m(b[0]))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-5, atol=1e-6)
    assert wrapped._ortrain_graph_breaks is not None and wrapped._ortrain_graph_breaks.graph_count > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
