"""Dropout draws eager's masks, and a wrapped model trains inside ``torch.utils.checkpoint``.

Dropout runs in PyTorch (``runtime/torch_native_ops.py``): under one seed its masks are eager's,
whichever placement op tuning runs and whichever graph (no-grad or training) draws them. A
checkpoint around the wrapper (each layer an ``ORTModule``, the loop checkpointing them) then
recomputes the forward with the forward's own masks, and its first step may capture inside it.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ortrain import ORTModule


@pytest.fixture(autouse=True)
def _automatic_op_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """As users run: op tuning switches a graph between placements in the first steps, which is
    where the masks of a forward and its recompute could differ."""
    monkeypatch.delenv("ORTMODULE_ENABLE_TUNING", raising=False)


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.drop(torch.nn.functional.gelu(self.up(x)))))


class Stack(nn.Module):
    """Blocks run one by one, each inside a checkpoint when ``checkpointing`` names the kind."""

    def __init__(self, blocks: list[nn.Module], checkpointing: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return x.square().mean()


def _train(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], list[torch.Tensor]]:
    """SGD over ``batches``, the generator seeded before each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step, x in enumerate(batches):
        torch.manual_seed(100 + step)
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _batches(steps: int, shape: tuple[int, ...], *, requires_grad: bool = False) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=generator).requires_grad_(requires_grad) for _ in range(steps)]


def _assert_same_training(eager: nn.Module, wrapped: nn.Module, batches: list[torch.Tensor]) -> None:
    eager_losses, eager_params = _train(eager, batches)
    losses, params = _train(wrapped, batches)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for got, expected in zip(params, eager_params, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_dropout_masks_are_eagers_under_the_same_seed() -> None:
    """ONNX Runtime's Dropout drew its own masks (reseeded from torch's generator, but another
    algorithm): losses differed from eager's from the first step. Op tuning switches placements
    in these steps, and the masks must not follow it."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(0.3), Block(0.3))
    eager = Stack([copy.deepcopy(b) for b in model], checkpointing=None)
    wrapped = ORTModule(Stack([copy.deepcopy(b) for b in model], checkpointing=None))
    _assert_same_training(eager, wrapped, _batches(8, (8, 5, 16)))


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("kind", ["non-reentrant", "reentrant"])
def test_wrapped_layers_inside_checkpoint_train_like_eager(kind: str, p: float) -> None:
    """Each layer an ORTModule, checkpointed from outside. Non-reentrant: the first step captured
    inside the checkpoint, whose hooks counted the trace's tensors as saved ("a different number of
    tensors was saved during the original forward and recomputation"), and the recompute's early
    stop was taken for an ONNX Runtime failure. With dropout, the recompute ran another placement
    than the forward (op tuning), so other masks: wrong gradients. Reentrant: the forward runs the
    no-grad graph, the recompute the training graph; they must draw the same masks."""
    torch.manual_seed(0)
    blocks = [Block(p) for _ in range(3)]
    eager = Stack([copy.deepcopy(b) for b in blocks], checkpointing=kind)
    wrapped = Stack([ORTModule(copy.deepcopy(b)) for b in blocks], checkpointing=kind)
    # A reentrant checkpoint sees gradients only through inputs that require them.
    _assert_same_training(eager, wrapped, _batches(6, (8, 5, 16), requires_grad=True))
    assert all(block._ortrain_graphs for block in wrapped.blocks)  # they ran on graphs


class _AttentionThenDropout(nn.Module):
    """``nn.MultiheadAttention(batch_first=True)`` returns a transposed view: eager's dropout after
    it draws its mask in that memory order."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)
        self.attention = nn.MultiheadAttention(32, 4, dropout=0.2, batch_first=True)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.drop(self.attention(h, h, h)[0]).square().mean()


@pytest.mark.parametrize("tuning", ["0", "automatic"])
def test_dropout_after_a_transpose_draws_eagers_masks(monkeypatch: pytest.MonkeyPatch, tuning: str) -> None:
    """A value from ONNX Runtime is contiguous where eager's was a transposed view: PyTorch's
    dropout drew other masks from it (losses off by 6e-4 at once), and other masks in the
    all-PyTorch placement than in ONNX Runtime's. Random operators now get the recorded layout."""
    if tuning == "0":
        monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")  # ONNX Runtime's placement from the start
    torch.manual_seed(0)
    model = _AttentionThenDropout()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    _assert_same_training(eager, wrapped, _batches(5, (4, 10, 32)))


class _EncoderDecoder(nn.Module):
    """Two chains that meet only at the end, with dropout in each, as an encoder and a decoder:
    eager draws the encoder's masks, then the decoder's."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.decoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = x[..., :8], x[..., 8:]
        for layer in self.encoder:
            h = nn.functional.dropout(torch.tanh(layer(h)), 0.3)
        for layer in self.decoder:
            g = nn.functional.dropout(torch.tanh(layer(g)), 0.3)
        return ((h * g).sum(-1) ** 2).mean()


@pytest.mark.parametrize("tuning", ["0", "automatic"])
def test_independent_chains_draw_in_eagers_order(monkeypatch: pytest.MonkeyPatch, tuning: str) -> None:
    """The partitioner merged the decoder's first dropout into one PyTorch region with an encoder
    dropout, which drew it before the encoder's later masks: other masks than eager's in ONNX
    Runtime's placement (Hugging Face's T5 and BART: losses off by 0.04 at the first step), and
    other masks than the all-PyTorch placement's that op tuning also runs
    (``runtime/draw_order.py``)."""
    if tuning == "0":
        monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    model = _EncoderDecoder()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    _assert_same_training(eager, wrapped, _batches(5, (4, 16)))


class _FirstTokenClassifier(nn.Module):
    """A token-wise block with dropout, then a classifier reading the first token: the compute
    optimizer runs the block's last layers on that token only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(x))
        h = h + self.drop(self.down(self.drop(torch.relu(self.up(h)))))
        return self.head(self.drop(h[:, 0])).logsumexp(-1).mean()


@pytest.mark.parametrize("tuning", ["0", "automatic"])
def test_dropout_before_a_moved_selection_draws_eagers_masks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tuning: str
) -> None:
    """Moved above the dropouts, the first-token selection made them draw masks for that token
    only: other numbers than eager's (ViT, DistilBERT: losses off by 5e-3 to 1e-2 at the first step).
    The mask is now drawn for the dense input and its rows selected (passes/selected_dropout.py),
    and the work saved stays saved. Two sequence lengths: the second capture has symbolic sizes."""
    if tuning == "0":
        monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    model = _FirstTokenClassifier()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    batches = _batches(3, (4, 6, 8)) + _batches(3, (4, 9, 8))
    with caplog.at_level(logging.INFO, logger="ortrain.passes"):
        _assert_same_training(eager, wrapped, batches)
    assert "compute optimizer: moved a select up past" in caplog.text


class _EncoderClassifier(nn.Module):
    """A ViT-style classifier: a transformer layer with dropout, then the first token."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True, norm_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)[:, 0]).logsumexp(-1).mean()


def test_a_transformer_layer_before_the_first_token_draws_eagers_masks(monkeypatch) -> None:
    """The attention's output (not contiguous) was dropped on the first token only, after the
    feed-forward's dropouts: other masks than eager's, losses 0.2 to 0.9 relative off (wave 44).
    Where a dropout's eager mask cannot be drawn densely, the selection stays below it."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    model = _EncoderClassifier()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    _assert_same_training(eager, wrapped, _batches(3, (2, 5, 16)) + _batches(2, (3, 7, 16)))


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, 32),
            nn.GELU(),
            nn.Dropout(0.3),
            nn.Linear(32, 32),
            nn.LayerNorm(32),
            nn.Dropout(0.3),
        )
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def _change(model: nn.Module, step: int) -> None:
    """What people do between steps: freeze and unfreeze, swap the head, switch one dropout off,
    change a rate, change the dtype."""
    if step == 2:
        model.body[0].requires_grad_(False)
    if step == 4:
        model.body[0].requires_grad_(True)
    if step == 5:
        torch.manual_seed(77)
        model.head = nn.Linear(32, 4)
    if step == 7:
        model.body[2].eval()
    if step == 8:
        model.body[2].train()
        model.body[5].p = 0.6
    if step == 10:
        model.double()


def test_model_changes_with_dropout_train_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """With eager's masks, a model with dropout can be held to eager's losses through the changes
    a training script makes (before, only dropout-free models could)."""
    # The default policy: ONNX Runtime's CPU kernels lack float64 GELU and LayerNorm, which then
    # run in PyTorch after the model turns double.
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    base = _Classifier()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def run(model: nn.Module, inner: nn.Module) -> list[float]:
        losses = []
        for step in range(12):
            _change(inner, step)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(step)
            loss = model(x.to(next(model.parameters()).dtype), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    eager = copy.deepcopy(base)
    wrapped = ORTModule(copy.deepcopy(base))
    torch.testing.assert_close(run(wrapped, wrapped.module), run(eager, eager), rtol=1e-5, atol=1e-6)


class _NormalizedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


def test_a_checkpoint_around_a_model_on_graph_breaks_repeats_the_forwards_side_effects() -> None:
    """A module hook sends the model through TorchDynamo's graph breaks. The checkpoint's recompute
    stopped inside the first graph's autograd Function, as soon as the last saved tensor was back:
    the graph's BatchNorm statistics write and Dynamo's replay of the hook's append came after
    it, so the statistics were updated once where eager updates them twice (wave 53's review)."""
    torch.manual_seed(0)
    eager = _NormalizedHead()
    wrapped = ORTModule(copy.deepcopy(eager))
    results = []
    for model, bn in ((eager, eager.bn), (wrapped, wrapped.module.bn)):
        calls: list[bool] = []
        bn.register_forward_hook(lambda module, args, out, calls=calls: calls.append(out.requires_grad))
        for step in range(2):
            x = (torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).requires_grad_(True)
            checkpoint(model, x, use_reentrant=False).pow(2).sum().backward()
        results.append((bn.num_batches_tracked.clone(), bn.running_mean.clone(), len(calls), x.grad))
        results[-1] += tuple(p.grad for p in model.parameters())
    assert wrapped._ortrain_graph_breaks is not None
    assert results[1][2] == results[0][2] == 4  # the hook ran in each forward and each recompute
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
