"""The forward rewrites on their own: the rewritten graph, run eagerly, gives the model's loss and gradients.

These tests need no ONNX Runtime: they trace the forward as ortrain does before capture, apply
the passes, and compare the rewritten graph (forward and autograd backward) with the model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import DebugOptions, ORTModule
from ortrain.capture.forward_rewrite import trace_forward
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT
from ortrain.passes.compute_optimizer import upstream_selections
from ortrain.passes.label_sparsity import gather_counted_labels
from ortrain.passes.padding_elimination import eliminate_padding

aten = torch.ops.aten


class Flat(nn.Module):
    """As ORTModule calls a model: flat tensors in, a tuple out, the model under ``.module``."""

    def __init__(self, module: nn.Module, outputs: slice = slice(None)) -> None:
        super().__init__()
        self.module = module
        self.outputs = outputs

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.module(*tensors)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o for o in out[self.outputs] if o is not None)


def _rewrite(flat: Flat, inputs: list[torch.Tensor], passes: list) -> tuple[torch.fx.GraphModule, list[str]]:
    trace = trace_forward(flat, inputs)
    assert trace is not None
    changes = [c for p in passes for c in p(trace.graph_module)]
    trace.graph_module.graph.eliminate_dead_code()
    trace.graph_module.recompile()
    return trace.graph_module, changes


def _state(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers())]


def _assert_same_loss_and_grads(flat: Flat, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> None:
    reference = copy.deepcopy(flat)
    expected = reference(*inputs)[0]
    expected.backward()
    state = _state(flat)
    got = gm(state, *inputs)[0]
    got.backward()
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(flat.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
        p.grad = None


def _targets(idx: torch.Tensor, counted: int) -> torch.Tensor:
    targets = idx.roll(-1, 1)
    targets.view(-1)[counted:] = -100
    return targets


@pytest.mark.parametrize("counted", [0, 1, 10, 20])
def test_label_gather_climbs_through_the_head(counted: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=2, d_model=8))
    flat = Flat(model, slice(1, 2))  # the loss only
    idx = torch.randint(0, 31, (2, 10))
    inputs = [idx, _targets(idx, counted)]
    gm, changes = _rewrite(flat, inputs, [gather_counted_labels, upstream_selections])
    assert changes[0].startswith("label sparsity: cross_entropy_loss")
    assert changes[1].startswith("compute optimizer: moved a index_select up past")
    # The head's linear now reads gathered rows.
    head = [n for n in gm.graph.nodes if n.target is aten.linear.default][-1]
    assert _depends_on(head, aten.index_select.default)
    _assert_same_loss_and_grads(flat, gm, inputs)


def _depends_on(node: torch.fx.Node, target: object) -> bool:
    """Whether ``node`` reads, directly or not, a node calling ``target``."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n.target is target:
            return True
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return False


def test_dynamic_sizes_are_rewritten_too() -> None:
    """A second sequence length makes ortrain capture with symbolic sizes; the rewrites still apply."""
    from ortrain.capture.aot_capture import _fake_inputs

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=2, d_model=8))
    flat = Flat(model, slice(1, 2))
    idx = torch.randint(0, 31, (2, 10))
    fakes = _fake_inputs([idx, _targets(idx, 5)], {0: (0, 1), 1: (0, 1)})
    trace = trace_forward(flat, fakes)
    assert trace is not None
    assert gather_counted_labels(trace.graph_module) and upstream_selections(trace.graph_module)
    trace.graph_module.recompile()
    for shape, counted in (((3, 7), 4), ((1, 12), 0)):
        idx = torch.randint(0, 31, shape)
        _assert_same_loss_and_grads(flat, trace.graph_module, [idx, _targets(idx, counted)])


def test_head_stays_dense_when_the_logits_are_an_output() -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=2, d_model=8))
    idx = torch.randint(0, 31, (2, 10))
    gm, changes = _rewrite(Flat(model), [idx, _targets(idx, 7)], [gather_counted_labels, upstream_selections])
    assert len(changes) == 1 and changes[0].startswith("label sparsity")  # nothing to move: logits are read
    loss = gm(_state(model), idx, _targets(idx, 7))[1]
    torch.testing.assert_close(loss, model(idx, _targets(idx, 7))[1])


def test_classifier_on_first_token_runs_last_mlp_on_that_token() -> None:
    class FirstToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 6)
            self.mlp = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
            self.cls = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.proj(x).softmax(dim=1)  # over the tokens: stands for attention
            h = h + self.mlp(h)
            return F.cross_entropy(self.cls(h[:, 0]), y)

    torch.manual_seed(0)
    flat = Flat(FirstToken())
    inputs = [torch.randn(4, 5, 6), torch.tensor([0, 1, 2, -100])]
    gm, changes = _rewrite(flat, inputs, [upstream_selections])
    assert changes == [
        "compute optimizer: moved a select up past 5 token-wise ops (2 linear, 1 layer_norm, 1 gelu, 1 add)"
    ]
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    # proj feeds the token-mixing softmax; the MLP's linears and the classifier read one token.
    assert [_depends_on(n, aten.select.int) for n in linears] == [False, True, True, True]
    _assert_same_loss_and_grads(flat, gm, inputs)


class _FirstTokenWithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.mlp = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Dropout(0.4), nn.Linear(12, 6))
        self.drop = nn.Dropout(0.4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).softmax(dim=1)  # over the tokens: stands for attention
        h = self.drop(h + self.mlp(h))
        return F.cross_entropy(h[:, 0], y)


def test_dropout_on_selected_rows_draws_eagers_mask() -> None:
    """The selection moves past both dropouts and the MLP; each mask is drawn for the dense rows
    (as eager draws it) and its selected rows applied, so one seed gives eager's loss and gradients."""
    torch.manual_seed(0)
    flat = Flat(_FirstTokenWithDropout())
    inputs = [torch.randn(4, 5, 6), torch.tensor([0, 1, 2, 5])]
    gm, changes = _rewrite(flat, inputs, [upstream_selections])
    assert changes == [
        "compute optimizer: moved a select up past 6 token-wise ops (2 linear, 2 dropout, 1 gelu, 1 add)"
    ]
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert [_depends_on(n, aten.select.int) for n in linears] == [False, True, True]
    masks = [n for n in gm.graph.nodes if n.target is aten.dropout.default]
    assert len(masks) == 2 and all(m.args[0].target is aten.ones_like.default for m in masks)
    torch.manual_seed(7)
    reference = copy.deepcopy(flat)
    expected = reference(*inputs)[0]
    torch.manual_seed(7)
    got = gm(_state(flat), *inputs)[0]
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    for p, q in zip(flat.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_dropout_of_a_permuted_input_keeps_the_selection_below_it() -> None:
    """Eager draws a transposed input's mask in its memory order, which ones laid out
    contiguously do not reproduce. Until wave 44 that dropout ran on the selected rows, with other
    masks than eager's (a ViT layer's attention output: losses 0.2-0.9 relative off eager's under
    one seed); now the selection stays where the model put it."""

    class Permuted(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = x.transpose(0, 1).contiguous().transpose(0, 1)  # (batch, tokens), tokens outermost
            return F.cross_entropy(F.dropout(h, 0.4)[:, 0], y)

    gm, changes = _rewrite(
        Flat(Permuted()), [torch.randn(4, 5, 6), torch.tensor([0, 1, 2, 5])], [upstream_selections]
    )
    assert changes == []
    (dropout,) = [n for n in gm.graph.nodes if n.target is aten.dropout.default]
    assert dropout.args[0].target is not aten.select.int


def test_only_reshapes_between_is_no_change() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 9)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.proj(x)
            return logits, F.cross_entropy(logits.reshape(-1, 9), y.reshape(-1))

    x, y = torch.randn(2, 3, 4), torch.tensor([[1, -100, 2], [-100, -100, 3]])
    _, changes = _rewrite(Flat(Head()), [x, y], [gather_counted_labels, upstream_selections])
    assert len(changes) == 1 and changes[0].startswith("label sparsity")


def test_reduction_none_is_left_dense() -> None:
    class PerRow(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(x, y, reduction="none")

    _, changes = _rewrite(
        Flat(PerRow()), [torch.randn(5, 3), torch.tensor([0, -100, 1, 2, -100])], [gather_counted_labels]
    )
    assert changes == []


def test_padding_elimination_on_bert_forward_and_backward() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip

    class MaskedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = transformers.BertForMaskedLM(config)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids, attention_mask=mask, labels=labels).loss

    ids = torch.randint(1, 40, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, 5:] = mask[2, 2:] = 0
    ids[mask == 0] = 0
    labels = torch.where(mask == 1, ids, -100)
    flat = Flat(MaskedLM())
    gm, changes = _rewrite(
        flat, [ids, mask, labels], [gather_counted_labels, eliminate_padding, upstream_selections]
    )
    assert any(c.startswith("padding elimination: ") for c in changes)
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert linears and all(
        _depends_on(n, aten.index_select.default) for n in linears
    )  # every linear runs on real tokens
    # the word embedding is looked up for the real tokens' ids (its gradient then adds no pad rows)
    lookups = [n for n in gm.graph.nodes if n.target is aten.embedding.default]
    assert any(n.args[1].target is aten.index_select.default for n in lookups)
    _assert_same_loss_and_grads(flat, gm, [ids, mask, labels])


def test_saved_onnx_shows_the_gather(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    torch.manual_seed(0)
    model = ORTModule(
        Flat(TinyGPT(GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=2, d_model=8)), slice(1, 2)),
        DebugOptions(save_onnx=True, onnx_prefix="sparse"),
    )
    idx = torch.randint(0, 31, (2, 10))
    model(idx, _targets(idx, 5))[0].backward()
    forward = onnx.load(tmp_path / "sparse_forward_optimized_training.onnx")
    ops = {n.op_type for n in forward.graph.node}
    assert {"NonZero", "Gather"} <= ops


class _PerSampleGate(nn.Module):
    """A forward that maps a function over the batch with torch.vmap, then a head and a loss that
    ignores labels (label sparsity would rewrite it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = torch.vmap(lambda row: row * row.sum(-1, keepdim=True).sigmoid())(self.embedding(idx))
        return F.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten(), ignore_index=-100)


def test_a_vmap_in_the_forward_is_captured_as_written(caplog: pytest.LogCaptureFixture) -> None:
    # The pre-dispatch trace does not follow torch.vmap: its graph read the mapped values as fake
    # constants, and the rewritten forward failed in AOTAutograd ("Mixing fake modes"), so the
    # whole model (Hugging Face's Mamba among them) fell back to PyTorch.
    torch.manual_seed(0)
    idx = torch.randint(0, 20, (2, 6))
    targets = _targets(idx, 5)
    with caplog.at_level("INFO", logger="ortrain.capture"):
        assert trace_forward(Flat(_PerSampleGate()), [idx, targets]) is None
    assert "lost the computation" in caplog.text
    model = _PerSampleGate()
    eager = copy.deepcopy(model)
    ort = ORTModule(model)  # FALLBACK_DISABLE (conftest): a failed capture raises
    for step in range(2):
        targets = _targets(idx, 3 + step)
        expected, got = eager(idx, targets), ort(idx, targets)
        torch.testing.assert_close(got, expected)
        expected.backward()
        got.backward()
        for p, q in zip(ort.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
