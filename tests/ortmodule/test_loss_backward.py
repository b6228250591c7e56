"""The loss backward (log_softmax + NLL / cross-entropy): eager's gradients, in few full-size passes.

Every loss variant trains one capture for four steps over batches whose label densities are 0,
0.1, 0.5 and 1 and compares the loss and every gradient with eager PyTorch at each step. The last
tests count, in the backward graph ONNX Runtime runs, the (rows x classes) tensors it produces and
how many are alive at once, so that the fused form cannot silently come undone.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTModule
from ortrain.runtime.executors.ort import DISABLED_OPTIMIZERS, session_options

DENSITIES = (0.0, 0.1, 0.5, 1.0)
ROWS, FEATURES, CLASSES = 12, 8, 37
aten = torch.ops.aten

LossFn = Callable[[torch.Tensor, torch.Tensor, "Head"], torch.Tensor]


def _row_scale(n: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, n)


# name -> (loss of (logits [rows, classes], target [rows], module), ignored label)
LOSSES: dict[str, tuple[LossFn, int]] = {
    "ce_mean": (lambda x, t, m: F.cross_entropy(x, t), -100),
    "ce_sum": (lambda x, t, m: F.cross_entropy(x, t, reduction="sum"), -100),
    "ce_none": (
        lambda x, t, m: (F.cross_entropy(x, t, reduction="none") * _row_scale(x.shape[0])).sum(),
        -100,
    ),
    "ce_ignore_3": (lambda x, t, m: F.cross_entropy(x, t, ignore_index=3), 3),
    "ce_weight": (lambda x, t, m: F.cross_entropy(x, t, weight=m.class_weight), -100),
    "ce_weight_sum": (lambda x, t, m: F.cross_entropy(x, t, weight=m.class_weight, reduction="sum"), -100),
    "ce_weight_none": (
        lambda x, t, m: F.cross_entropy(x, t, weight=m.class_weight, reduction="none").sum(),
        -100,
    ),
    "ce_smoothing": (lambda x, t, m: F.cross_entropy(x, t, label_smoothing=0.1), -100),
    "ce_smoothing_weight_sum": (
        lambda x, t, m: F.cross_entropy(x, t, weight=m.class_weight, label_smoothing=0.2, reduction="sum"),
        -100,
    ),
    "nll_log_softmax": (lambda x, t, m: F.nll_loss(F.log_softmax(x, dim=-1), t), -100),
    # 3-D logits (batch, classes, positions) go through nll_loss2d, whose gradient is reshaped back
    # before log_softmax's backward: decomposed on the row scale, not fused.
    "ce_classes_dim1": (
        lambda x, t, m: F.cross_entropy(x.view(3, 4, CLASSES).transpose(1, 2), t.view(3, 4)),
        -100,
    ),
    # A hand-written cross-entropy: gather's backward is a one-hot scatter too.
    "gather": (
        lambda x, t, m: (
            -(F.log_softmax(x, dim=-1).gather(1, t.clamp(min=0)[:, None]).squeeze(1) * (t >= 0)).sum()
        ),
        -100,
    ),
    # NLL on log-probabilities that are not log_softmax's: only the NLL gradient changes.
    "nll_log_sigmoid": (lambda x, t, m: F.nll_loss(F.logsigmoid(x), t), -100),
}


class Head(nn.Module):
    """Features -> logits -> loss, the tail of a language model."""

    def __init__(self, loss: LossFn) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.register_buffer("class_weight", torch.linspace(0.2, 2.0, CLASSES))
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.proj(x)))
        return self.loss(logits, target, self)


def _batches(ignore: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for density in DENSITIES:
        x = torch.randn(ROWS, FEATURES, generator=generator).to(dtype)
        target = torch.randint(0, CLASSES, (ROWS,), generator=generator)
        target[target == ignore] = 0
        counted = torch.zeros(ROWS, dtype=torch.bool)
        counted[torch.randperm(ROWS, generator=generator)[: round(density * ROWS)]] = True
        target[~counted] = ignore
        batches.append((x, target))
    return batches


def _backward_targets(model: ORTModule) -> set[Any]:
    entries = [e for group in model._ortrain_graphs.values() for e in group]
    assert len(entries) == 1, "one capture serves every density"
    backward = entries[0].capture.backward
    assert backward is not None
    return {n.target for n in backward.graph.graph.nodes if n.op == "call_function"}


def _train_and_compare(
    model: nn.Module, batches: list[Any], *, rtol: float = 1e-4, atol: float = 1e-6
) -> ORTModule:
    """SGD steps on an ORTModule and an eager copy; the loss and every gradient compared each step."""
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    opt_ort = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate(batches):
        opt_ort.zero_grad()
        opt_eager.zero_grad()
        loss_ort, loss_eager = wrapped(*batch), eager(*batch)
        loss_ort.backward()
        loss_eager.backward()
        torch.testing.assert_close(loss_ort, loss_eager, rtol=rtol, atol=atol, equal_nan=True)
        expected = dict(eager.named_parameters())
        for name, param in wrapped.named_parameters():
            torch.testing.assert_close(
                param.grad,
                expected[name].grad,
                rtol=rtol,
                atol=atol,
                msg=lambda m, n=name, s=step: f"step {s}, {n}: {m}",
            )
        opt_ort.step()
        opt_eager.step()
    return wrapped


def _set_sparsity(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", "1" if on else "0")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # ONNX Runtime runs the loss backward
    # the loss backward these tests examine; fused with its linear layer, it runs in the forward
    monkeypatch.setenv("ORTMODULE_FUSE_LINEAR_CROSS_ENTROPY", "0")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "label-sparsity"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_variants_match_eager(monkeypatch: pytest.MonkeyPatch, name: str, sparse: bool) -> None:
    loss, ignore = LOSSES[name]
    _set_sparsity(monkeypatch, sparse)
    torch.manual_seed(0)
    wrapped = _train_and_compare(Head(loss), _batches(ignore))
    targets = _backward_targets(wrapped)
    fused = aten._log_softmax_backward_data.default not in targets  # fused with the one-hot gradient
    assert fused == (name != "ce_classes_dim1")
    assert aten.nll_loss_backward.default not in targets  # decomposed on the row scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["ce_mean", "ce_weight_none", "ce_smoothing"])
def test_low_precision_matches_eager(monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype) -> None:
    loss, ignore = LOSSES[name]
    _set_sparsity(monkeypatch, True)
    # ONNX Runtime's CPU kernels lack most half-precision ops: those run in PyTorch.
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    torch.manual_seed(0)
    model = Head(loss).to(dtype)
    wrapped = _train_and_compare(model, _batches(ignore, dtype), rtol=2e-2, atol=2e-3)
    assert aten._log_softmax_backward_data.default not in _backward_targets(wrapped)


def test_no_counted_label_gives_nan_loss_and_zero_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_sparsity(monkeypatch, False)
    torch.manual_seed(0)
    wrapped = ORTModule(Head(LOSSES["ce_mean"][0]))
    x, target = torch.randn(ROWS, FEATURES), torch.full((ROWS,), -100)
    loss = wrapped(x, target)
    loss.backward()
    assert math.isnan(loss.item())
    for name, param in wrapped.named_parameters():
        assert param.grad is not None and not param.grad.any(), name


# --- what ONNX Runtime runs -------------------------------------------------------------------


class _TinyLM(nn.Module):
    """Rows x features -> logits -> cross-entropy; returns the logits too when asked."""

    def __init__(self, vocab: int, return_logits: bool) -> None:
        super().__init__()
        self.head = nn.Linear(FEATURES, vocab)
        self.return_logits = return_logits

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> Any:
        logits = self.head(x)
        loss = F.cross_entropy(logits, target)
        return (logits, loss) if self.return_logits else loss


def _run_graph(model: onnx.ModelProto, tmp_path: Any) -> onnx.ModelProto:
    """The backward graph as ONNX Runtime optimizes it with ortrain's session options."""
    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(
        model.SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=DISABLED_OPTIMIZERS,
    )
    return onnx.shape_inference.infer_shapes(onnx.load(options.optimized_model_filepath))


def _full_size_counts(model: onnx.ModelProto, numel: int) -> tuple[int, int]:
    """(nodes producing a tensor of ``numel`` elements or more, most such intermediates alive at once).

    A value is alive from the node that produces it to its last reader; graph inputs (the saved
    log-probabilities, the logits' gradient) are the caller's and not counted.
    """
    sizes: dict[str, int] = {}
    for info in model.graph.value_info:
        dims = info.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            sizes[info.name] = math.prod(d.dim_value for d in dims)
    nodes = list(model.graph.node)
    last_use = {name: i for i, node in enumerate(nodes) for name in node.input}
    outputs = {o.name for o in model.graph.output}
    producing, alive, peak = 0, set(), 0
    for i, node in enumerate(nodes):
        big = [o for o in node.output if sizes.get(o, 0) >= numel]
        producing += len(big)
        alive |= set(big)
        peak = max(peak, len(alive))
        alive -= {name for name in node.input if last_use.get(name) == i and name not in outputs}
    return producing, peak


@pytest.mark.parametrize(
    ("return_logits", "sparse", "most_made"),
    [(False, False, 3), (True, False, 4), (True, True, 1)],
    ids=["loss-only", "logits-and-loss", "logits-and-loss-label-sparsity"],
)
def test_loss_backward_passes_and_live_tensors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, return_logits: bool, sparse: bool, most_made: int
) -> None:
    """Before, ONNX Runtime ran zeros, scatter, mul, exp, mul and sub over the logits' size (5
    nodes); returning the logits added AOTAutograd's gradient for them (6). Now: Exp, Mul,
    ScatterElements(add) (in place), and the Add of the logits' gradient. With label sparsity the
    loss runs on the counted rows (a row count known at run time: not counted here) and their
    gradient went into a zeros tensor the size of the logits, then the logits' gradient was added
    (ConstantOfShape, ScatterND, Add: 3); now the rows, each added to the gradient's own, are written
    back into it (ScatterND at the counted rows, which never repeat: 1)."""
    _set_sparsity(monkeypatch, sparse)
    vocab, rows = 1009, 64
    torch.manual_seed(0)
    wrapped = ORTModule(_TinyLM(vocab, return_logits))
    x, target = torch.randn(rows, FEATURES), torch.randint(0, vocab, (rows,))
    target[::3] = -100
    out = wrapped(x, target)
    (out[1] if return_logits else out).backward()
    (entry,) = [e for group in wrapped._ortrain_graphs.values() for e in group]
    backward = entry.capture.backward
    assert backward is not None
    (runner,) = backward.runner.runners  # type: ignore[union-attr]
    optimized = _run_graph(runner.exported.model, tmp_path)
    producing, peak = _full_size_counts(optimized, rows * vocab)
    ops = [n.op_type for n in optimized.graph.node]
    assert "ScatterElements" in ops
    assert producing <= most_made, ops
    assert peak <= 2, ops
