"""Linear + cross-entropy with gradients in the forward: the same loss and gradients as eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTModule
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT, TinyGPTLoss
from ortrain.ortmodule.memory_reports import memory_reports
from ortrain.passes import linear_cross_entropy as lce

ROWS, D, V = 24, 8, 50


def _inputs(density: float, *, bias: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, D, generator=generator, requires_grad=True)
    w = torch.randn(V, D, generator=generator, requires_grad=True)
    b = torch.randn(V, generator=generator, requires_grad=True) if bias else None
    target = torch.randint(0, V, (ROWS,), generator=generator)
    target[torch.rand(ROWS, generator=generator) >= density] = -100
    return x, w, b, target


@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize(
    ("reduction", "smoothing", "sparse", "logits_given"),
    [
        ("mean", 0.0, True, False),
        ("sum", 0.0, False, False),
        ("mean", 0.2, True, True),
        ("sum", 0.1, False, True),
    ],
)
def test_loss_and_gradients_equal_eager_in_chunks(
    monkeypatch: pytest.MonkeyPatch,
    density: float,
    reduction: str,
    smoothing: float,
    sparse: bool,
    logits_given: bool,
) -> None:
    monkeypatch.setattr(lce, "CHUNK_BYTES", 7 * V * 4)  # at most 7 rows a chunk: 4 even chunks
    assert lce._chunk_rows(ROWS, V) == [6, 6, 6, 6]
    x, w, b, target = _inputs(density, bias=True)
    expected = F.cross_entropy(F.linear(x, w, b), target, reduction=reduction, label_smoothing=smoothing)
    (expected * 2.5).backward()  # a loss gradient other than 1, as under loss scaling
    grads = [t.grad.clone() for t in (x, w, b)]  # type: ignore[union-attr]
    for t in (x, w, b):
        t.grad = None  # type: ignore[union-attr]
    logits = F.linear(x, w, b) if logits_given else None
    got = lce.linear_cross_entropy(
        x, w, b, logits, target, {"mean": 1, "sum": 2}[reduction], -100, smoothing, sparse
    )
    (got * 2.5).backward()
    torch.testing.assert_close(got, expected, equal_nan=True)
    for name, t, grad in zip("xwb", (x, w, b), grads, strict=True):
        torch.testing.assert_close(t.grad, grad, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[union-attr]


@pytest.mark.parametrize("sparse", [True, False])
def test_a_sum_divided_by_no_counted_labels_gives_zero_gradients_as_eager(sparse: bool) -> None:
    """The Hugging Face Trainer's ``sum / num_items_in_batch`` with nothing counted: the loss's
    gradient is inf. Until wave 42 it multiplied the zero gradients (NaN in every gradient of the
    model); eager's backward writes zeros."""
    x, w, b, target = _inputs(0.0, bias=True)
    expected = F.cross_entropy(F.linear(x, w, b), target, reduction="sum") / torch.tensor(0.0)
    expected.backward()
    grads = [t.grad.clone() for t in (x, w, b)]  # type: ignore[union-attr]
    assert all(not g.any() for g in grads)
    for t in (x, w, b):
        t.grad = None  # type: ignore[union-attr]
    got = lce.linear_cross_entropy(x, w, b, None, target, 2, -100, 0.0, sparse) / torch.tensor(0.0)
    got.backward()
    torch.testing.assert_close(got, expected, equal_nan=True)
    for name, t, grad in zip("xwb", (x, w, b), grads, strict=True):
        torch.testing.assert_close(t.grad, grad, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[union-attr]


def test_only_what_requires_grad_gets_a_gradient() -> None:
    x, w, _, target = _inputs(0.5, bias=False)
    w.requires_grad_(False)
    loss = lce.linear_cross_entropy(x, w, None, None, target, 1, -100, 0.0, True)
    loss.backward()
    assert w.grad is None and x.grad is not None
    with torch.no_grad():
        assert not lce.linear_cross_entropy(x, w, None, None, target, 1, -100, 0.0, True).requires_grad


def test_rows_are_split_into_chunks_of_at_most_chunk_bytes() -> None:
    per_chunk = lce.CHUNK_BYTES // (4 * 8000)
    sizes = lce._chunk_rows(26 * 512, 8000)
    assert sizes is not None and sum(sizes) == 26 * 512 and max(sizes) <= per_chunk
    assert lce._chunk_rows(per_chunk, 8000) is None  # fits in one chunk


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=211, block_size=16, n_layer=1, n_head=2, d_model=16))


def _train(model: torch.nn.Module, returns_logits: bool, steps: int = 3) -> ORTModule:
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, eager)]
    generator = torch.Generator().manual_seed(3)
    for step in range(steps):
        idx = torch.randint(0, 211, (3, 16), generator=generator)
        targets = torch.randint(0, 211, (3, 16), generator=generator)
        targets[torch.rand(3, 16, generator=generator) < 0.3] = -100
        losses = []
        for m, opt in zip((wrapped, eager), optimizers, strict=True):
            opt.zero_grad()
            out = m(idx, targets)
            loss = out[1] if returns_logits else out
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        grads = dict(eager.named_parameters())
        for name, p in wrapped.named_parameters():
            torch.testing.assert_close(
                p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name, s=step: f"{s} {n}: {m}"
            )
        for opt in optimizers:
            opt.step()
    return wrapped


def _changes(wrapped: ORTModule) -> list[str]:
    """The forward rewrites of the one whole-model capture (not a graph-break fallback)."""
    entries = [e for group in wrapped._ortrain_graphs.values() for e in group]
    assert len(entries) == 1
    trace = entries[0].capture.forward_trace
    return [] if trace is None else [c for c in trace.changes if c.startswith("linear cross-entropy")]


@pytest.mark.parametrize("returns_logits", [False, True], ids=["loss", "logits-and-loss"])
def test_tiny_gpt_trains_as_eager_in_chunks(monkeypatch: pytest.MonkeyPatch, returns_logits: bool) -> None:
    monkeypatch.setattr(lce, "CHUNK_BYTES", 10 * 211 * 4)  # 48 rows: 5 chunks
    model = _gpt()
    wrapped = _train(model if returns_logits else TinyGPTLoss(model), returns_logits)
    lines = _changes(wrapped)
    assert len(lines) == 1 and ("logits returned" in lines[0]) == returns_logits


def test_tied_head_and_embedding_train_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lce, "CHUNK_BYTES", 10 * 211 * 4)
    model = _gpt()
    model.head.weight = model.tok.weight  # GPT-2's tied embedding: two gradients add up
    assert len(_changes(_train(TinyGPTLoss(model), returns_logits=False))) == 1


def test_nothing_of_rows_times_vocabulary_is_stashed_for_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    stashed = {}
    for on in (True, False):
        monkeypatch.setenv("ORTMODULE_FUSE_LINEAR_CROSS_ENTROPY", "1" if on else "0")
        monkeypatch.setenv("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", "0")
        wrapped = _train(TinyGPTLoss(_gpt()), returns_logits=False, steps=1)
        assert len(_changes(wrapped)) == on
        stashed[on] = sum(r.stashed_bytes for r in memory_reports(wrapped))
    rows_by_vocabulary = 3 * 16 * 211 * 4
    # the log-softmax (rows x V) is gone; A W (rows x d) and A^T x (V x d) are stashed instead
    assert stashed[False] - stashed[True] >= rows_by_vocabulary - (3 * 16 + 211) * 16 * 4


def test_freezing_the_head_while_training_is_seen() -> None:
    """The fused loss computes only the gradients that are wanted at capture: freezing the head
    (and unfreezing it again) after a step must re-capture, not reuse a graph that gives the head
    a gradient (or none)."""
    model = _gpt()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(TinyGPTLoss(model))
    eager_loss = TinyGPTLoss(eager)
    generator = torch.Generator().manual_seed(5)
    for head_trains in (True, False, True):
        for m in (model, eager):
            m.head.weight.requires_grad_(head_trains)
            m.zero_grad(set_to_none=True)
        idx = torch.randint(0, 211, (3, 16), generator=generator)
        targets = torch.randint(0, 211, (3, 16), generator=generator)
        wrapped(idx, targets).backward()
        eager_loss(idx, targets).backward()
        assert (model.head.weight.grad is None) == (not head_trains)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(
                    p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
                )


@pytest.mark.parametrize("sparse", [False, True])
def test_the_heads_gradients_make_no_tensor_of_zeros_the_heads_size(sparse: bool) -> None:
    """The weight and bias gradients start from the first chunk and take the one-hot term off the
    product in place: no (V x d) or (V,) zeros filled, scaled and subtracted (three passes over
    the head's size each)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w, b, target = _inputs(0.5, bias=True)

    def loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return lce.linear_cross_entropy(x, w, b, None, target, 1, -100, 0.0, sparse)

    graph = make_fx(loss)(x, w, b, target).graph
    zero_shapes = [
        tuple(n.meta["val"].shape)
        for n in graph.nodes
        if n.op == "call_function"
        and n.target in (torch.ops.aten.zeros.default, torch.ops.aten.new_zeros.default)
    ]
    assert (V, D) not in zero_shapes and (V,) not in zero_shapes


class _TwoTokenHead(torch.nn.Module):
    """Multi-token prediction: one head of 2 x V outputs, viewed as two rows of V classes each."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.vocab = vocab
        self.embedding = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, 2 * vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embedding(ids))).view(-1, self.vocab)
        return F.cross_entropy(logits, labels.view(-1))


class _SequenceFirst(torch.nn.Module):
    """The head reads a transposed hidden state: its input is not contiguous."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.vocab = vocab
        self.embedding = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embedding(ids.t()))  # sequence, batch, width
        return F.cross_entropy(self.head(hidden.transpose(0, 1)).reshape(-1, self.vocab), labels.reshape(-1))


@pytest.mark.parametrize(
    "model_class", [_TwoTokenHead, _SequenceFirst], ids=["two-token-head", "sequence-first"]
)
def test_heads_that_are_not_one_row_per_input_row_train_as_eager(
    monkeypatch: pytest.MonkeyPatch, model_class: type
) -> None:
    """Wave 41: a head of 2 x V outputs viewed as rows of V was fused as a loss over 2 x V classes
    (loss 4.73 where eager gave 4.03, silently), and a transposed head input failed the gather's
    ``view`` and fell back to PyTorch."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = model_class()
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    ids = torch.randint(0, 50, (2, 6))
    width = 2 * 6 if model_class is _TwoTokenHead else 6
    labels = torch.randint(0, 50, (2, width))
    labels[1] = -100  # every counted label in the first half of the rows
    expected, got = eager(ids, labels), wrapped(ids, labels)
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected)
    for (name, a), b in zip(wrapped.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


class _TargetsFromPositions(torch.nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), torch.arange(x.shape[0]) % self.head.out_features)


def test_targets_covering_every_class_once_keep_the_softmax_gradient() -> None:
    # Wave 49's review: at batch = classes the one-hot term's scatter covered every row, and
    # onnxscript's ScatterAllStatic replaced it by its updates, dropping the softmax part:
    # the bias gradient came out -1/N everywhere.
    torch.manual_seed(0)
    eager = _TargetsFromPositions(4)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 4)
    eager(x).backward()
    wrapped(x).backward()
    torch.testing.assert_close(wrapped.head.bias.grad, eager.head.bias.grad)
    torch.testing.assert_close(wrapped.head.weight.grad, eager.head.weight.grad)
