"""Operators ONNX Runtime cannot run go to PyTorch, one by one; the rest stays in ONNX Runtime."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.errors import ORTModuleONNXModelException
from ortrain.export import direct_translation, fx_to_onnx
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT


class _Segments(nn.Module):
    """``torch.segment_reduce`` (no ONNX translation, forward nor backward) between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 3)
        self.register_buffer("lengths", torch.tensor([3, 5]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        sums = torch.segment_reduce(h, "sum", lengths=self.lengths, axis=0)
        return self.second(h[:2] * sums).pow(2).mean()


class _FloorOfReciprocal(nn.Module):
    """``1.0 // x``: ``floor_divide`` with a Python number first, which onnxscript's translation
    (0.7) cannot take as it is ("'float' object has no attribute 'dtype'")."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        scale = 1.0 // (h.detach().abs().amax(0) + 0.5)
        return self.second(torch.tanh(h) * (scale + 1)).square().mean()


class _LinearAlgebra(nn.Module):
    """Factorizations and an FFT of complex intermediates (no ONNX equivalent) among Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 3)
        self.square = nn.Parameter(torch.randn(6, 6) / 3 + 2 * torch.eye(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        gram = h.transpose(0, 1) @ h + torch.eye(6)
        spread = torch.linalg.eigh(gram).eigenvalues.sqrt()
        solved = torch.linalg.solve(self.square, h.transpose(0, 1)).transpose(0, 1)
        mixed = h @ torch.linalg.inv(self.square) + torch.linalg.cholesky(gram).sum(0)
        singular = torch.linalg.svdvals(self.square).sum()
        frequencies = torch.fft.rfftfreq(6)  # decomposed (wave 51: refused, no translation)
        smooth = torch.fft.irfft(torch.fft.rfft(h, dim=-1) * (1 + frequencies), n=6, dim=-1)
        return self.second(mixed * spread + solved + smooth).pow(2).mean() + singular


def _runners(wrapped: ORTModule) -> list:
    entries = [e for entries in wrapped._ortrain_graphs.values() for e in entries]
    assert len(entries) == 1
    capture = entries[0].capture
    return [capture.forward.runner, capture.backward.runner]


def _train(
    model: nn.Module, batches: list, loss_fn, *, lr: float = 0.05
) -> tuple[list, list, nn.Module, ORTModule]:
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    losses: tuple[list, list] = ([], [])
    for module, out in ((wrapped, losses[0]), (eager, losses[1])):
        opt = torch.optim.SGD(module.parameters(), lr=lr)
        for batch in batches:
            opt.zero_grad()
            loss = loss_fn(module, batch)
            loss.backward()
            opt.step()
            out.append(loss.detach().float())
    return losses[0], losses[1], eager, wrapped


def _assert_close_state(a: nn.Module, b: nn.Module, rtol: float, atol: float) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(
            pa.float(), pb.float(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def _trains_like_eager_warning(
    model: nn.Module, caplog, *, rtol: float, atol: float
) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Four SGD steps with eager's losses and parameters, no whole-model fallback; the nodes each
    executor ran in the forward and the backward, and the warnings naming what went to PyTorch."""
    torch.manual_seed(0)
    batches = [torch.randn(8, 6) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        got, want, eager, wrapped = _train(model, batches, lambda m, x: m(x))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=rtol, atol=1e-6)
    _assert_close_state(wrapped, eager, rtol=rtol, atol=atol)
    assert wrapped._ortrain_fallback.reason is None
    forward, backward = (r.plan.nodes_by_executor() for r in _runners(wrapped))
    warned = [r.getMessage() for r in caplog.records if "run in PyTorch because" in r.getMessage()]
    return forward, backward, warned


def test_an_op_without_onnx_translation_runs_alone_in_pytorch(monkeypatch, caplog) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    forward, backward, warned = _trains_like_eager_warning(_Segments(), caplog, rtol=1e-4, atol=1e-5)
    # Only segment_reduce runs in PyTorch in the forward, only its gradient in the backward.
    assert forward["torch"] == 1 and forward["onnxruntime"] >= 5
    assert backward["torch"] == 1 and backward["onnxruntime"] >= 15
    assert len(warned) == 2 and "aten.segment_reduce.default (no ONNX translation)" in warned[0]


def test_a_node_whose_translation_fails_runs_alone_in_pytorch(monkeypatch, caplog) -> None:
    """The exporter names the node it failed on; every node of its region went to PyTorch (IBert:
    65 of them). (`1.0 // x` translates since numbers in tensor operands became tensors,
    ortrain/export/number_operands.py: without that step its translation fails as it did.)"""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    for module in (fx_to_onnx, direct_translation):
        monkeypatch.setattr(module, "tensors_for_number_operands", lambda gm: 0)
    forward, _, warned = _trains_like_eager_warning(_FloorOfReciprocal(), caplog, rtol=1e-5, atol=1e-6)
    assert forward["torch"] == 1 and forward["onnxruntime"] >= 8
    assert len(warned) == 1 and "aten.floor_divide.default (its translation failed: " in warned[0]


class _DilatedUpsampling(nn.Module):
    """A transposed convolution whose output_padding is not below its stride (PyTorch allows it
    with a larger dilation; ONNX Runtime's ConvTranspose fails on it when the session runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.up = nn.ConvTranspose1d(6, 4, 3, stride=2, dilation=3, output_padding=2)
        self.second = nn.Linear(36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)).unsqueeze(-1)
        return self.second(self.up(h).flatten(1)).pow(2).mean()


def test_an_argument_onnx_runtimes_kernel_fails_on_runs_alone_in_pytorch(monkeypatch, caplog) -> None:
    """Wave 37: the node exported and its session loaded, so the first run failed and the whole
    model went back to PyTorch; now it is refused at partitioning (ort_kernel_limits.py)."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    forward, _, warned = _trains_like_eager_warning(_DilatedUpsampling(), caplog, rtol=1e-4, atol=1e-5)
    assert forward["torch"] == 1 and forward["onnxruntime"] >= 4
    assert len(warned) == 1
    assert "output_padding [2] not below the stride [2]" in warned[0]


@pytest.mark.parametrize(
    ("norm_type", "dtype", "why"),
    [
        (float("inf"), torch.float32, "computes norm_type=inf as a sum of powers"),
        (float("-inf"), torch.float32, "computes norm_type=-inf as a sum of powers"),
        (2.0, torch.float64, "rounds max_norm to float32 in a float64 embedding"),
    ],
)
def test_an_embedding_renorm_its_translation_gets_wrong_runs_in_pytorch(
    monkeypatch, caplog, norm_type, dtype, why
) -> None:
    """``nn.Embedding(max_norm=0.5, norm_type=inf)``: onnxscript's renorm took the row norm as
    ``sum(|w|^p)^(1/p)`` = 1 and scaled every looked-up row by max_norm (a loss 0.16 for eager's
    0.39, the weight itself renormed wrong); in float64 it rounded max_norm to float32."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    eager = nn.Embedding(
        10, 4, max_norm=0.5 if dtype == torch.float32 else 0.3, norm_type=norm_type, dtype=dtype
    )
    with torch.no_grad():
        eager.weight.mul_(0.3)
    wrapped = ORTModule(copy.deepcopy(eager))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for step in range(3):
            ids = torch.tensor([[1, 2, 3], [3, 7, step]])
            for m in (eager, wrapped):
                m.zero_grad()
                m(ids).sin().sum().backward()
                with torch.no_grad():
                    m.weight -= 0.5 * m.weight.grad
            torch.testing.assert_close(wrapped.module.weight, eager.weight, rtol=1e-12, atol=1e-7)
    assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_fallback_disable_names_the_operator() -> None:
    with pytest.raises(
        ORTModuleONNXModelException, match=r"aten\.segment_reduce\.default \(no ONNX translation\)"
    ):
        ORTModule(_Segments())(torch.randn(8, 6))


def test_operators_without_onnx_equivalent_run_in_pytorch_by_design_under_fallback_disable(caplog) -> None:
    """Factorizations and complex tensors (ortrain/runtime/torch_native_ops.py) are no refusal:
    FALLBACK_DISABLE trains the model with eager's gradients, the rest in ONNX Runtime, without
    a warning; one INFO line per graph names what PyTorch runs."""
    torch.manual_seed(0)
    batches = [torch.randn(8, 6) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="ortrain.runtime"):  # ORTModule sets "ortrain"'s
        got, want, eager, wrapped = _train(_LinearAlgebra(), batches, lambda m, x: m(x))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-5)
    _assert_close_state(wrapped, eager, rtol=1e-4, atol=1e-4)
    assert wrapped._ortrain_fallback.reason is None
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and "OMP_WAIT" not in r.getMessage()
    ]
    forward, backward = (r.plan.nodes_by_executor() for r in _runners(wrapped))
    assert forward["onnxruntime"] >= 10 and forward["torch"] >= 5
    assert backward["onnxruntime"] >= 15 and backward["torch"] >= 1
    named = [r.getMessage() for r in caplog.records if "by design" in r.getMessage()]
    assert len(named) == 2 and named[0].startswith("forward graph")
    for op in ("_linalg_eigh", "_linalg_solve_ex", "linalg_inv_ex", "linalg_cholesky_ex", "_linalg_svd"):
        assert f"aten.{op}.default x1 (linear algebra)" in named[0]
    assert "aten._fft_r2c.default x1 (complex tensor)" in named[0]


class _GraphConvolution(nn.Module):
    """A graph network's layer: a sparse adjacency matrix times the nodes' features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, adjacency: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.sparse.mm(adjacency, self.linear(features))).pow(2).mean()


def test_sparse_tensors_stay_in_pytorch(caplog) -> None:
    """The backward's ``mm(adjacency.t(), grad)`` has a translation: from the third step (ONNX
    Runtime's session after the first calls' PyTorch run) the session got the sparse matrix and
    failed with "unsupported memory format option Contiguous"."""
    torch.manual_seed(0)
    edges = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 2]])
    adjacency = torch.sparse_coo_tensor(edges, torch.rand(6), (5, 5), check_invariants=True)
    batches = [torch.randn(5, 6) for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="ortrain.runtime"):
        got, want, eager, wrapped = _train(_GraphConvolution(), batches, lambda m, x: m(adjacency, x))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    _assert_close_state(wrapped, eager, rtol=1e-5, atol=1e-6)
    forward, backward = (r.plan.nodes_by_executor() for r in _runners(wrapped))
    assert forward["onnxruntime"] >= 2 and backward["onnxruntime"] >= 3
    named = [r.getMessage() for r in caplog.records if "by design" in r.getMessage()]
    assert "aten._sparse_addmm.default x1 (sparse tensor)" in named[0]
    assert "aten.mm.default x1 (sparse tensor)" in named[1]


class _LearnedAdjacency(nn.Module):
    """A graph layer whose sparse adjacency the forward builds from learned edge weights."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.edge_weight = nn.Linear(6, 1)

    def forward(self, edges: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        h = self.encoder(features)
        weights = torch.sigmoid(self.edge_weight(h[edges[0]] * h[edges[1]])).squeeze(-1)
        adjacency = torch.sparse_coo_tensor(edges, weights, (h.shape[0], h.shape[0]))
        return torch.sparse.mm(adjacency, h).pow(2).mean()


def test_a_sparse_tensor_built_in_the_forward_trains_through_graph_breaks(monkeypatch, caplog) -> None:
    """The whole-graph capture fails in the sparse constructor's backward ("invalid gradient"), and
    the model trained in PyTorch for good (wave 51's review); TorchDynamo's graphs keep the rest."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    edges = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 2]])
    batches = [torch.randn(5, 6) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="ortrain"):
        got, want, eager, wrapped = _train(_LearnedAdjacency(), batches, lambda m, x: m(edges, x))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    _assert_close_state(wrapped, eager, rtol=1e-5, atol=1e-6)
    assert wrapped._ortrain_fallback.reason is None and wrapped._ortrain_graph_breaks is not None
    assert any("failed on a sparse tensor the forward builds" in r.getMessage() for r in caplog.records)


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_mlp_trains_with_each_node_where_it_can_run(
    monkeypatch, caplog, dtype, tolerance
) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16).to(dtype), torch.randint(0, 4, (8,))) for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="ortrain"):
        got, want, eager, wrapped = _train(
            _mlp().to(dtype), batches, lambda m, b: F.cross_entropy(m(b[0]).float(), b[1])
        )
    # The precision is the user's choice and PyTorch's kernels are eager's: said at INFO, no warning.
    named = [r for r in caplog.records if "run in PyTorch because" in r.getMessage()]
    assert len(named) == 2 and {r.levelno for r in named} == {logging.INFO}
    assert f"kernel for {str(dtype).removeprefix('torch.')}" in named[0].getMessage()
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=tolerance, atol=tolerance)
    _assert_close_state(wrapped, eager, rtol=tolerance, atol=tolerance)
    assert wrapped._ortrain_fallback.reason is None
    counts = [r.plan.nodes_by_executor() for r in _runners(wrapped)]
    # The CPU provider has no bfloat16/float16 Gemm or MatMul: those run in PyTorch, decided per
    # operator (the mixed split is checked on the tiny GPT below, whose float32 loss is inside).
    assert all(c["torch"] >= 3 for c in counts)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)]
)
def test_tiny_gpt_parity_in_each_dtype(monkeypatch, dtype, tolerance) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32)
    batches = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(3)]
    got, want, eager, wrapped = _train(
        TinyGPT(config).to(dtype), batches, lambda m, b: m(b[0], b[1])[1].float(), lr=0.1
    )
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=tolerance, atol=tolerance)
    _assert_close_state(wrapped, eager, rtol=tolerance, atol=tolerance)
    forward, backward = (r.plan.nodes_by_executor() for r in _runners(wrapped))
    if dtype == torch.float32:
        assert set(forward) == set(backward) == {"onnxruntime"}  # the one-session fast path
    else:  # the float32 loss at least runs in ONNX Runtime
        assert forward["onnxruntime"] >= 1 and forward["torch"] >= 1
