"""Memory optimizer: plans found on a GPT block, levels, the config, and what really crosses to backward."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import test_parity_zoo
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn

from ortrain import ORTModule
from ortrain.capture.aot_capture import Capture, capture
from ortrain.capture.memory_optimizer import MemoryOptimizerConfig, MemoryReport, RecomputeRequest
from ortrain.capture.memory_summary import format_summary
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT
from ortrain.ortmodule.memory_reports import memory_reports
from ortrain.ortmodule.options import parse_memory_opt_config, runtime_options

# Attention's q, k and v (from the fused projection's split): what PyTorch's flash kernel saves.
QKV = "Gemm+Split+"


class _Loss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(idx, targets)[1],)


def _gpt(n_layer: int = 2, attention: str = "sdpa") -> TinyGPT:
    torch.manual_seed(0)
    config = GPTConfig(64, block_size=16, n_layer=n_layer, n_head=2, d_model=16, attention=attention)
    return TinyGPT(config)


def _capture(model: nn.Module, level: int = 0, config: str = "") -> tuple[Capture, list[torch.Tensor]]:
    torch.manual_seed(1)
    idx = torch.randint(0, 64, (4, 16))
    inputs = [idx, torch.roll(idx, -1, dims=1)]
    memory = MemoryOptimizerConfig(level, parse_memory_opt_config(config))
    return capture(_Loss(model), inputs, training=True, memory=memory), inputs


def _saved_bytes(captured: Capture, model: nn.Module, inputs: list[torch.Tensor]) -> int:
    """Bytes autograd saves between this forward and its backward, but parameters and inputs."""
    alive_anyway = {t.data_ptr() for t in (*model.parameters(), *inputs)}
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if tensor.data_ptr() not in alive_anyway:
            total += tensor.numel() * tensor.element_size()
        return tensor

    state = dict(_Loss(model).named_parameters(remove_duplicate=False))
    state.update(_Loss(model).named_buffers(remove_duplicate=False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (loss,) = captured([state[n] for n in captured.state_names], inputs)
    loss.backward()
    return total


def _report(captured: Capture) -> MemoryReport:
    assert captured.memory_report is not None
    return captured.memory_report


def test_summary_lists_the_patterns_of_a_gpt_block(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ortrain.capture")
    captured, _ = _capture(_gpt(n_layer=2))
    report = _report(captured)
    found = {p.pattern: p for p in report.plans}
    # Two LayerNorms a block and the final one; one GELU and one attention softmax chain a block.
    assert [o.layer for o in found["LayerNormalization+"].occurrences] == [
        "model.blocks.0",
        "model.blocks.0",
        "model.blocks.1",
        "model.blocks.1",
        None,
    ]
    assert found["Gelu+"].layers == ["model.blocks.0", "model.blocks.1"]
    assert found[QKV].layers == ["model.blocks.0", "model.blocks.1"]
    assert found["MatMul+LogSoftmax+"].level == 2  # recomputing it costs the head's matmul
    # Sizes and costs at the captured batch (4 x 16 tokens, d 16, 2 heads, MLP 64).
    assert found["Gelu+"].shape == "(4, 16, 64)"
    assert found["Gelu+"].bytes_per_occurrence == 4 * 16 * 64 * 4
    # SDPA is captured as PyTorch's flash kernel, as eager runs it: no batch x heads x seq x seq
    # probabilities are stashed, so none are listed (nor recomputed at level 0).
    assert not any("Softmax" in p.pattern for p in report.plans if p.pattern != "MatMul+LogSoftmax+")
    assert found[QKV].level == 2  # rebuilding q, k and v costs the projection's matmul
    assert all(p.requested is None and p.applied == 0 for p in report.plans)  # level 0, no config
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "memory optimizer summary" in logged
    assert "| Gelu+ " in logged and "2 (1/layer x 2)" in logged and "5 (2/layer x 2 + 1)" in logged


@pytest.mark.parametrize("rewrites", [True, False], ids=["rewritten-forward", "module-as-written"])
def test_a_rewritten_forward_names_the_same_layers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, rewrites: bool
) -> None:
    """The loss fusion and label sparsity rewrite the forward before AOTAutograd traces it; the
    joint graph must still tell which block each saved activation belongs to (when the summary
    is read: logged at INFO)."""
    caplog.set_level(logging.INFO, logger="ortrain.capture")
    for name in ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "ORTMODULE_ENABLE_SPARSE_OPTIMIZER"):
        monkeypatch.setenv(name, "1" if rewrites else "0")
    wrapped = ORTModule(_Loss(_gpt(n_layer=2)))
    idx = torch.randint(0, 64, (4, 16))
    wrapped(idx, torch.roll(idx, -1, dims=1))[0].backward()
    ((entry,),) = wrapped._ortrain_graphs.values()
    trace = entry.capture.forward_trace
    assert bool(trace and trace.changes) == rewrites
    (report,) = memory_reports(wrapped)
    found = {p.pattern: p for p in report.plans}
    # (rewritten, the last block's MLP runs on the counted rows: its GELU has a run-time size)
    assert found["Gelu+"].layers[0] == "module.model.blocks.0"
    assert found[QKV].layers == ["module.model.blocks.0", "module.model.blocks.1"]


def test_levels_and_config_choose_the_applied_counts(caplog: pytest.LogCaptureFixture) -> None:
    model = _gpt(n_layer=2)
    report = _report(_capture(model, level=1)[0])
    applied = {p.pattern: p.applied for p in report.plans}
    assert (
        applied["LayerNormalization+"] == 5 and applied["Gelu+"] == 2 and applied["Gather+Gather+Add+"] == 1
    )
    assert applied["Gemm+"] == 0 and applied["MatMul+LogSoftmax+"] == 0  # matmul plans wait for level 2
    assert all(p.applied == len(p.occurrences) for p in _report(_capture(model, level=2)[0]).plans)

    with caplog.at_level(logging.WARNING, logger="ortrain.capture"):
        report = _report(_capture(model, level=1, config="LayerNormalization+:1:2,Gelu+:0:-1,Nope+:1:-1")[0])
    applied = {p.pattern: p.applied for p in report.plans}
    assert applied["LayerNormalization+"] == 2  # the count asked for, in forward order
    assert applied["Gelu+"] == 0  # type 0 switches a level's plan off
    assert applied["Gather+Gather+Add+"] == 1  # the level's choice where the config says nothing
    assert report.unknown_patterns == ["Nope+"]
    assert any("Nope+" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "LayerNormalization+:1:2" in format_summary(report)


def test_an_unknown_pattern_is_warned_about_once_per_wrapper(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning came again at every capture: the static one, then the dynamic re-capture."""
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:1:-1,Bogus+:1:-1")
    torch.manual_seed(0)
    wrapped = ORTModule(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for rows in (2, 3, 4):
            wrapped(torch.randn(rows, 8)).sum().backward()
    assert len(memory_reports(wrapped)) == 2  # captured again, with dynamic sizes
    assert all(r.unknown_patterns == ["Bogus+"] for r in memory_reports(wrapped))
    warnings = [r.getMessage() for r in caplog.records if "Bogus+" in r.getMessage()]
    assert warnings == [
        "memory optimizer: no subgraph matches Bogus+ in this model; the patterns found are listed "
        "in the memory optimizer summary (ORTMODULE_LOG_LEVEL=INFO)"
    ]


def _eager_saved_bytes(model: nn.Module, inputs: list[torch.Tensor]) -> int:
    """Bytes eager autograd saves for backward, but parameters and inputs (views counted once)."""
    alive_anyway = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *inputs)}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in alive_anyway:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _Loss(model)(*inputs)[0]
    loss.backward()
    return sum(storages.values())


@pytest.mark.parametrize("attention", ["sdpa", "softmax"])
def test_default_stashes_no_more_than_eager_saves(attention: str) -> None:
    """Level 0 stashes at most what eager autograd saves (counted tensor by tensor, not timed).

    Eager's fused SDPA kernel saves no attention probabilities, and neither does the capture,
    which keeps that kernel (until wave 9 it traced the math form and level 0 recomputed them).
    """
    model = _gpt(n_layer=2, attention=attention)
    captured, inputs = _capture(model)
    stashed = _saved_bytes(captured, model, inputs)
    eager = _eager_saved_bytes(model, inputs)
    assert stashed <= eager, (stashed, eager)
    report = _report(captured)
    assert stashed == report.stashed_bytes
    # Nothing for level 0 to recompute: with flash nothing of seq x seq is stashed; spelled-out
    # attention stashes its probabilities, as eager saves them.
    assert report.applied_bytes == 0


def test_saved_activation_bytes_drop_as_the_summary_says() -> None:
    model = _gpt(n_layer=1)
    baseline, inputs = _capture(model)  # level 0 recomputes nothing here
    before = _saved_bytes(baseline, model, inputs)
    assert before == _report(baseline).stashed_bytes_before == _report(baseline).stashed_bytes
    for level, config in ((0, "Gelu+:1:-1,LayerNormalization+:1:1"), (1, ""), (2, "")):
        captured, inputs = _capture(model, level, config)
        report = _report(captured)
        assert report.applied_bytes > 0
        assert _saved_bytes(captured, model, inputs) == before - report.applied_bytes, (level, config)
        assert report.stashed_bytes == before - report.applied_bytes
    # Level 1 frees the GELU output and the block's two LayerNorm outputs at least.
    level1 = _report(_capture(model, 1)[0])
    assert level1.applied_bytes >= 4 * 16 * 64 * 4 + 2 * 4 * 16 * 16 * 4


@pytest.mark.parametrize(
    ("level", "config", "attention"),
    [(1, "", "softmax"), (2, "", "sdpa"), (0, "Gelu+:1:-1,Gemm+:1:1,LayerNormalization+:1:2", "sdpa")],
)
def test_training_matches_eager_with_recompute(
    monkeypatch: pytest.MonkeyPatch, level: int, config: str, attention: str
) -> None:
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", str(level))
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", config)
    torch.manual_seed(2)
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(3)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        _gpt(n_layer=1, attention=attention), batches, lambda m, b: m(b, torch.roll(b, -1, dims=1))[1]
    )
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)
    (report,) = memory_reports(wrapped)
    assert report.applied_bytes > 0
    if config:
        assert report.plan("Gemm+").applied == 1 and report.plan("LayerNormalization+").applied == 2


@pytest.mark.parametrize("level", [0, 1])
def test_level_1_leaves_gelu_backward_to_pytorch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    # Its ONNX translation keeps three activation-sized temporaries alive (the backward's peak).
    from ortrain.runtime.executors.torch import TorchExecutor

    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", str(level))
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(2)
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(2)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        _gpt(n_layer=2), batches, lambda m, b: m(b, torch.roll(b, -1, dims=1))[1]
    )
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)
    runners = dict(wrapped.graph_runners())
    in_torch = [
        node
        for step in runners["backward"].plan.steps
        if isinstance(step.executor, TorchExecutor)
        for node in step.nodes
        if node.target is torch.ops.aten.gelu_backward.default
    ]
    assert len(in_torch) == (2 if level else 0)
    said = [r.getMessage() for r in caplog.records if "(memory optimizer: one pass" in r.getMessage()]
    assert len(said) == (1 if level else 0)
    if level:
        assert said[0].startswith("backward graph: PyTorch runs aten.gelu_backward.default x2"), said[0]


def test_the_torch_compile_backend_leaves_gelu_backward_to_pytorch_at_level_1(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The same variable means the same for torch.compile(backend="ortrain") as for ORTModule.
    from _compile_parity import train_compiled_side_by_side

    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    caplog.set_level(logging.INFO, logger="ortrain.runtime")
    torch.manual_seed(2)
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(2)]
    model = _gpt(n_layer=2)
    losses_ort, losses_eager, eager, _ = train_compiled_side_by_side(
        model, batches, lambda m, b: m(b, torch.roll(b, -1, dims=1))[1]
    )
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=1e-6)
    assert_same_state(model, eager)
    said = [r.getMessage() for r in caplog.records if "(memory optimizer: one pass" in r.getMessage()]
    assert said and all(m.startswith("backward graph: PyTorch runs aten.gelu_backward.default") for m in said)


def test_dropout_is_never_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recomputed dropout would draw a new mask in backward: the gradient would be wrong."""
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "2")
    test_parity_zoo.test_dropout_mask_is_the_same_in_forward_and_backward()


@pytest.mark.parametrize("level", [1, 2])
def test_batch_norm_in_training_trains_as_eager_at_every_level(
    monkeypatch: pytest.MonkeyPatch, level: int
) -> None:
    """Batch norm updates its running statistics in place: recomputed in the backward, it read the
    buffer the forward had written, and every backward failed ("modified by an inplace operation")
    at levels 1 and 2 until wave 43."""
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", str(level))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)
    )
    model(torch.randn(2, 3, 8, 8))
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))) for _ in range(3)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        model, batches, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)


def test_bad_config_is_an_error_naming_the_entry(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:1:-1, Softmax+:one:2")
    with pytest.raises(ValueError, match=r"entry 'Softmax\+:one:2' is not pattern:type:count"):
        runtime_options()
    for bad in ("Gelu+:3:-1", "Gelu+:1:0", "Gelu+:1", ":1:1"):
        with pytest.raises(ValueError, match="ORTMODULE_MEMORY_OPT_CONFIG entry"):
            parse_memory_opt_config(bad)
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "")
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "3")
    with pytest.raises(ValueError, match="ORTMODULE_MEMORY_OPT_LEVEL='3' is not a level"):
        runtime_options()

    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps(["Gelu+:1:-1", "LayerNormalization+:2:3"]))
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", str(plans))
    options = runtime_options()
    assert options.memory_opt_level == 1
    assert options.memory_opt_config == (
        RecomputeRequest("Gelu+", 1, -1),
        RecomputeRequest("LayerNormalization+", 2, 3),
    )
    plans.write_text('{"Gelu+": 1}')
    with pytest.raises(ValueError, match="JSON list of strings"):
        runtime_options()


def _train_with_one_seed(
    monkeypatch: pytest.MonkeyPatch, level: int, steps: int = 2
) -> tuple[list[float], ORTModule]:
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", str(level))
    torch.manual_seed(3)
    config = GPTConfig(64, block_size=16, n_layer=1, n_head=2, d_model=16, dropout=0.3, attention="softmax")
    model = ORTModule(TinyGPT(config))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Dropout draws its masks from torch's generator, as in eager.
    losses = []
    for step in range(steps):
        idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = model(idx, torch.roll(idx, -1, dims=1))[1]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def test_dropout_outputs_are_rebuilt_from_their_stashed_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Level 1 recomputes dropout outputs from the forward's masks: same training as level 0."""
    losses_0, model_0 = _train_with_one_seed(monkeypatch, 0)
    losses_1, model_1 = _train_with_one_seed(monkeypatch, 1)
    (report,) = memory_reports(model_1)
    assert report.plan("DropoutFromMask+").applied == 1  # the attention probabilities' dropout
    # Not bitwise (the graphs differ, so do ONNX Runtime's fusions), but a redrawn mask (30%
    # dropout) would move the first loss, the parameters and the second loss by far more than this.
    torch.testing.assert_close(losses_0[0], losses_1[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(losses_0, losses_1, rtol=1e-5, atol=1e-5)
    assert_same_state(model_0, model_1, atol=1e-5)


class _Noisy(nn.Module):
    """Noise from a random op, then a float64 exp: its recompute must stash the float32 noise."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp((x * self.w + 0.1 * torch.rand_like(x)).double())


def test_compromise_plan_stashes_a_smaller_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(8, 32)
    report = _report(capture(_Noisy(), [x], training=True))
    (plan,) = report.plans
    assert plan.kind == 2 and plan.saved_fraction == 0.5 and plan.applied == 0
    assert "recompute with compromise" in format_summary(report)
    # Asked for as a plain recompute it is refused with a warning (it would stash the noise anyway).
    refused = capture(
        _Noisy(),
        [x],
        training=True,
        memory=MemoryOptimizerConfig(0, parse_memory_opt_config(f"{plan.pattern}:1:-1")),
    )
    assert _report(refused).applied_bytes == 0

    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "2")
    model = ORTModule(_Noisy())
    y = model(x)
    y.sum().backward()
    (report,) = memory_reports(model)
    assert report.plans[0].applied == 1
    assert report.stashed_bytes == report.stashed_bytes_before - 8 * 32 * 4
    # d/dw sum(exp(x w + noise)) = sum_batch(exp(...) x): the recomputed exp saw the forward's noise.
    torch.testing.assert_close(model.w.grad, (y * x).sum(0).float())


def test_sizes_without_a_value_are_estimated_within_their_bounds() -> None:
    """Sizes found from data (rows a boolean mask selects: XMOD's language adapters) have no value
    when the summary counts bytes; PyTorch bounds an unknown one by its own infinity, which claims
    to be finite, and reading it as a number failed the capture ("'Infinity' object has no
    attribute '_mpf_'"): the model trained in PyTorch."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ortrain.capture.memory_optimizer import _hint

    shape_env = ShapeEnv()
    unbounded = shape_env.create_unbacked_symint()
    assert _hint(unbounded) == 1 and _hint(unbounded * 16) == 1
    bounded = shape_env.create_unbacked_symint()
    torch._check(bounded <= 12)
    assert _hint(bounded) == 12
    assert _hint(7) == 7


class _RunningRms(nn.Module):
    """Divides by a running mean square it first updates in place (an EMA buffer written, then read)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)
        self.register_buffer("ema", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.pow(2).mean(0))
        return self.l2(h / (self.ema + 1e-3).sqrt())


def _spectral_norm_mlp() -> nn.Module:
    # Its power iteration writes the buffers _u and _v in place, then reads them (and views of them).
    from torch.nn.utils.parametrizations import spectral_norm

    return nn.Sequential(spectral_norm(nn.Linear(8, 32)), nn.LeakyReLU(0.2), nn.Linear(32, 1))


@pytest.mark.parametrize(
    ("make", "level"),
    [(_RunningRms, 1), (_RunningRms, 2), (_spectral_norm_mlp, 2)],
    ids=["ema-1", "ema-2", "sn-2"],
)
def test_a_buffer_written_then_read_in_the_forward_trains_as_eager(
    monkeypatch: pytest.MonkeyPatch, make: type[nn.Module], level: int
) -> None:
    """A recompute in the backward read the buffer's new value (the forward read the old one): every
    backward failed with "modified by an inplace operation" at levels 1 and 2 until wave 54."""
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", str(level))
    torch.manual_seed(0)
    batches = [torch.randn(12, 8) for _ in range(3)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(
        make(), batches, lambda m, b: m(b).pow(2).mean()
    )
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-6)  # the buffers too
    (report,) = memory_reports(wrapped)
    assert report.applied_bytes > 0  # the plans that do not read the buffer still apply


class _Bf16Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(self.ln(x)))))


def _bf16_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for _ in range(2):  # the second call runs the captured graphs
        model.zero_grad()
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
    return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_a_dropout_rebuilt_from_its_mask_is_the_kernels_output_in_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dropout kernel scales by 1 / (1 - p) rounded to bfloat16; the rebuilt output multiplied by
    the float and was one bfloat16 unit off the forward's (wave 54: level 1 moved output and grads)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")  # bf16 Gemm
    x = torch.randn(16, 32)
    torch.manual_seed(0)
    eager = _Bf16Block()
    results = {}
    for level in (0, 1):
        monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", str(level))
        wrapped = ORTModule(copy.deepcopy(eager))
        results[level] = _bf16_step(wrapped, x)
        if level:
            (report,) = memory_reports(wrapped)
            assert report.plan("Gelu+DropoutFromMask+").applied == 1
    out_eager, _ = _bf16_step(eager, x)
    assert torch.equal(results[1][0], out_eager)
    assert torch.equal(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


class _Convolutions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=False)  # (2, 8, 6, 6): 2 * 576 * 4 * 9 FLOPs
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)  # 2 * 576 * 4 * 9
        self.up = nn.ConvTranspose2d(8, 6, 2, stride=2, bias=False)  # from (2, 8, 6, 6): 2 * 576 * 6 * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.grouped(torch.tanh(self.conv(x)).exp())
        return self.up(h.sin()).cos().sum()


def test_convolutions_are_counted_and_planned_as_matmuls() -> None:
    """A convolution was counted at 1 FLOP an output element and recomputed at level 1, which is
    documented as plans without a linear layer's matmul (wave 54: 0.5 MFLOP for a 302 MFLOP one)."""
    torch.manual_seed(0)
    captured = capture(
        _Convolutions(), [torch.randn(2, 4, 6, 6)], training=True, memory=MemoryOptimizerConfig(1)
    )
    report = _report(captured)
    flops = {p.pattern: (p.flops_per_occurrence, p.level, p.applied) for p in report.plans}
    conv = 2 * 576 * 4 * 9
    assert flops["Convolution+Tanh+"] == (conv + 4 * 576, 2, 0)  # tanh: 4 FLOPs an element
    assert flops["Convolution+"] == (conv, 2, 0)  # the grouped one: 4 input channels a group
    assert flops["Convolution+#2"] == (2 * 576 * 6 * 4, 2, 0)  # the transposed one
    assert flops["Exp+"] == flops["Sin+"] == (576, 1, 1)  # level 1 still applies the cheap ones
    assert "| Convolution+ " in format_summary(report)


def test_a_mistyped_pattern_is_warned_about_with_the_closest_found(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``Gelu`` (no ``+``) and ``layernormalization+`` matched nothing and the warning left the user to
    find the spelling in the summary (wave 54's review)."""
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu:1:-1,layernormalization+:1:-1,Bogus+:1:-1")
    torch.manual_seed(0)
    wrapped = ORTModule(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1)))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        wrapped(torch.randn(2, 8)).sum().backward()
    warnings = [r.getMessage() for r in caplog.records if "no subgraph matches" in r.getMessage()]
    assert warnings == [
        "memory optimizer: no subgraph matches Gelu (did you mean Gelu+?), layernormalization+ (did you "
        "mean LayerNormalization+?), Bogus+ in this model; the patterns found are listed in the memory "
        "optimizer summary (ORTMODULE_LOG_LEVEL=INFO)"
    ]


def test_a_small_activation_reads_above_zero_in_the_summary() -> None:
    """A plan's 3 KB read "0.00" MiB beside its share freed (wave 54's review)."""

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Embedding(64, 4), nn.GELU(), nn.Linear(4, 64))

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.layers(idx)
            return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    report = _report(_capture(Tiny())[0])
    gelu = next(p for p in report.plans if p.pattern == "Gelu+")
    assert 0 < gelu.bytes_per_occurrence < 0.005 * 2**20
    row = next(line for line in format_summary(report).splitlines() if line.startswith("| Gelu+ "))
    assert f"| {gelu.bytes_per_occurrence / 2**20:.2g} " in row
