"""Gradient penalties through ORTModule: the gradient with respect to an input, differentiated again."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTModule
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT
from ortrain.ortmodule import create_graph


def _critic(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "spectral_norm":  # power iteration writes its vectors at every training forward
        first: nn.Module = nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 8, 3, padding=1))
        return nn.Sequential(first, nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8 * 64, 1))
    # Dropout draws, BatchNorm writes its statistics: the recompute must start where the forward did.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.LeakyReLU(0.2),
        nn.BatchNorm2d(8),
        nn.Dropout(0.3),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.Softplus(),
        nn.Flatten(),
        nn.Linear(8 * 16, 1),
    )


def _r1_step(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """StyleGAN's R1: the squared gradient norm at real samples."""
    real = real.clone().requires_grad_(True)
    scores = critic(real)
    (grad,) = torch.autograd.grad(scores.sum(), real, create_graph=True)
    penalty = grad.pow(2).flatten(1).sum(1).mean()
    loss = F.softplus(-scores).mean() + F.softplus(critic(fake)).mean() + 5 * penalty
    return loss, penalty


def _wgan_gp_step(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """WGAN-GP: the gradient norm pulled to 1 between real and fake samples."""
    mix = torch.rand(real.shape[0], 1, 1, 1, generator=torch.Generator().manual_seed(7))
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty, penalty


@pytest.mark.parametrize(
    ("kind", "step"),
    [("dropout_batchnorm", _r1_step), ("spectral_norm", _wgan_gp_step), ("dropout_batchnorm", _wgan_gp_step)],
    ids=["r1-dropout-batchnorm", "wgan_gp-spectral_norm", "wgan_gp-dropout-batchnorm"],
)
def test_a_gradient_penalty_trains_like_eager(
    kind: str, step: Callable[..., tuple[torch.Tensor, ...]]
) -> None:
    """The penalty's gradient reaches the parameters through the second-order graph: losses,
    penalties, parameters and buffers equal eager's over several Adam steps (before, the step
    raised AOTAutograd's 'does not currently support double backward')."""
    eager = _critic(kind)
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (eager, wrapped)]
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        real, fake = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
        results = []
        for model, optimizer in zip((eager, wrapped), optimizers, strict=True):
            torch.manual_seed(100 + s)
            loss, penalty = step(model, real, fake)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            results.append((loss.detach(), penalty.detach()))
        assert results[1][1] > 0
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(list(wrapped.parameters()), list(eager.parameters()), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(list(wrapped.buffers()), list(eager.buffers()), rtol=1e-5, atol=1e-6)
    assert list(wrapped.graph_runners())  # the steps ran captured graphs, not the model's Python


def _hooked_call(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if kind == "checkpoint":
        return torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    return model(x)


def _saved_tensor_hooks(kind: str) -> contextlib.AbstractContextManager[object]:
    if kind == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu()
    if kind == "pass-through":
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    return contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["save_on_cpu", "pass-through", "checkpoint"])
def test_a_gradient_penalty_under_saved_tensor_hooks_trains_like_eager(kind: str) -> None:
    """Under saved-tensor hooks each saved tensor unpacks as an object of its own: the recompute
    matched the call's tensors by identity and raised a bare KeyError (wave 53's review)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (eager, wrapped):
        for _ in range(2):
            xi = x.clone().requires_grad_(True)
            with _saved_tensor_hooks(kind):
                scores = _hooked_call(kind, model, xi)
                (grad,) = torch.autograd.grad(scores.sum(), xi, create_graph=True)
                (scores.mean() + (grad.norm(dim=1) - 1).pow(2).mean()).backward()
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_an_input_gradient_backward_keeps_pytorchs_retain_graph_rules() -> None:
    """On the ordinary path (an input requires grad, no create_graph) a retained graph backs up
    twice, like eager, and a third backward without it raises PyTorch's own error."""
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 6)
    grads = []
    for model in (eager, wrapped):
        xi = x.clone().requires_grad_(True)
        out = model(xi).sum()
        out.backward(retain_graph=True)
        out.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.backward()
        grads.append((xi.grad, *(p.grad for p in model.parameters())))
    torch.testing.assert_close(grads[1], grads[0])


class _WithWrappedBlock(nn.Module):
    """An eager model with one ORTModule block: the block's input is an activation, not a leaf."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(6, 8)
        block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))
        self.block = ORTModule(block) if wrap else block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.sin(self.pre(x)))


def test_a_penalty_through_a_wrapped_block_reaches_the_layers_before_it() -> None:
    eager, wrapped = _WithWrappedBlock(wrap=False), _WithWrappedBlock(wrap=True)
    for s in range(2):
        results = []
        for model in (eager, wrapped):
            torch.manual_seed(s)
            x = torch.randn(5, 6, requires_grad=True)
            y = model(x * 2)
            (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            model.zero_grad()
            (y.mean() + grad.pow(2).sum()).backward()
            results.append([p.grad for p in model.parameters()])
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_the_recompute_runs_under_the_forwards_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward under bfloat16 autocast and the penalty's gradient taken after the region ends:
    the recompute runs in bfloat16, as the forward did (in float32 the penalty's gradients were
    off by 2.6e-2)."""
    # ONNX Runtime's CPU build has no bfloat16 Conv or Gemm: those run in PyTorch, per operator.
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    torch.manual_seed(0)
    layers = (nn.Conv2d(3, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8 * 64, 1))
    eager = nn.Sequential(*layers)
    wrapped = ORTModule(copy.deepcopy(eager))
    grads = []
    for model in (eager, wrapped):
        real = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = model(real)
        assert scores.dtype == torch.bfloat16
        (grad,) = torch.autograd.grad(scores.float().sum(), real, create_graph=True)
        grad.float().pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == 3  # the conv's weight and bias, the linear's weight
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def _tiny_gpt() -> TinyGPT:
    # Attention spelled out: PyTorch's CPU flash attention has no double backward, in eager too.
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16, dropout=0.1)
    torch.manual_seed(0)
    return TinyGPT(dataclasses.replace(config, attention="softmax"))


def test_a_gradient_norm_penalty_on_the_parameters_trains_like_eager() -> None:
    """A second-order term in the parameters alone (no input requires grad): the gradients of the
    loss, taken with a graph, penalized by their norm. It raised 'does not currently support
    double backward' until every training call took the twice-differentiable path."""
    eager = _tiny_gpt()
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    for s in range(3):
        ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(s))
        losses = []
        for model, optimizer in zip((eager, wrapped), optimizers, strict=True):
            torch.manual_seed(s)  # the same dropout masks
            loss = model(ids, torch.roll(ids, -1, dims=1))[1]
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, create_graph=True)
            total = loss + 0.1 * sum(g.pow(2).sum() for g in grads)
            optimizer.zero_grad()
            total.backward()
            optimizer.step()
            losses.append(total.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(list(wrapped.parameters()), list(eager.parameters()), rtol=1e-4, atol=1e-6)


class _SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.emb(ids).mean(1)))


def test_a_penalty_in_a_model_with_a_sparse_embedding_trains_like_eager() -> None:
    # Wave 49's review: the recompute's aliases were views, whose backward reshaped the
    # embedding's sparse gradient ("reshape is not implemented for sparse tensors").
    torch.manual_seed(0)
    eager = _SparseLookup().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 20, (4, 5))
    for model in (eager, wrapped):
        loss = model(ids).pow(2).sum()
        (weight_grad,) = torch.autograd.grad(loss, model.fc.weight, create_graph=True)
        (loss + weight_grad.pow(2).sum()).backward()
    assert wrapped.emb.weight.grad.layout == torch.sparse_coo
    torch.testing.assert_close(wrapped.emb.weight.grad.to_dense(), eager.emb.weight.grad.to_dense())
    torch.testing.assert_close(wrapped.fc.weight.grad, eager.fc.weight.grad)


def test_second_order_maml_through_functional_call_reads_the_fast_weights() -> None:
    """MAML with two inner steps: the second inner loss runs on fast weights passed with
    torch.func.functional_call, and its gradient is taken with a graph. The recompute must read
    those weights, not the model's own (the gradient then missed the fast weights entirely:
    'appears to not have been used in the graph')."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    wrapped = ORTModule(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(1)
    x_s, y_s, x_q, y_q = (torch.randn(8, n, generator=g) for n in (4, 1, 4, 1))
    results = []
    for model in (eager, wrapped):
        fast = dict(model.named_parameters())
        for _ in range(2):
            inner = (torch.func.functional_call(model, fast, (x_s,)) - y_s).pow(2).mean()
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
            fast = {name: w - 0.1 * grad for (name, w), grad in zip(fast.items(), grads, strict=True)}
        outer = (torch.func.functional_call(model, fast, (x_q,)) - y_q).pow(2).mean()
        outer.backward()
        results.append([outer.detach(), *(p.grad for p in model.parameters())])
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.linear(x).tanh()


def test_a_model_that_writes_into_its_input_refuses_second_order_loudly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its recompute would read the written input: such a call keeps the first-order graph, says
    so at the first create_graph backward, and the second-order backward raises."""
    monkeypatch.setattr(create_graph, "_warned", False)
    wrapped = ORTModule(_WritesItsInput())
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        out = wrapped(torch.randn(3, 4)).sum()
        grads = torch.autograd.grad(out, list(wrapped.parameters()), create_graph=True)
    warnings = [r.getMessage() for r in caplog.records if "create_graph=True" in r.getMessage()]
    assert len(warnings) == 1 and "writes into its input" in warnings[0] and "wrapped.module" in warnings[0]
    assert "graph breaks" not in warnings[0]  # the reason of this call alone
    with pytest.raises(RuntimeError, match="double backward"):
        sum(g.pow(2).sum() for g in grads).backward()


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight  # bound to the graph under two names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.embed(ids))).flatten(0, 1), ids.flatten())


def test_a_tied_weight_gets_its_gradient_once() -> None:
    """A weight bound twice (an embedding tied to the head) is one tensor: the node returns its
    gradient once, where autograd.grad over the list with it twice gave it the whole gradient at
    both places (twice eager's), first order and second order."""
    eager = _TiedLM()
    wrapped = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (eager, wrapped):
        loss = model(ids)
        (first,) = torch.autograd.grad(loss, [model.embed.weight], create_graph=True)
        (loss + first.pow(2).sum()).backward()
        grads.append(model.embed.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_hooks_on_parameters_and_inputs_run_once() -> None:
    """A hook that halves a parameter's gradient (registered after the first step) and one on the
    input: each runs once per backward, as in eager (the node computed gradients up to the
    tensors themselves, and a parameter's hook ran twice: a quarter of its gradient)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped = ORTModule(copy.deepcopy(eager))
    results = []
    for model in (eager, wrapped):
        calls: list[str] = []
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        model(x).sum().backward()  # the first step, before any hook
        for p in model.parameters():
            p.grad = None
            p.register_hook(lambda g, calls=calls: calls.append("param") or g * 0.5)
        xi = x.clone().requires_grad_(True)
        xi.register_hook(lambda g, calls=calls: calls.append("input") or g * 3)
        out = model(xi).sum()
        (first,) = torch.autograd.grad(out, xi, create_graph=True)
        (out + first.pow(2).sum()).backward()
        results.append(([p.grad for p in model.parameters()], sorted(calls)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-7)
    assert results[1][1] == results[0][1]


def test_batched_vector_jacobian_products_match_eager() -> None:
    """``autograd.grad(..., is_grads_batched=True)`` and ``jacobian(vectorize=True)`` hand the
    backward vmap's batched gradients: until wave 42 ONNX Runtime's executor failed on them
    ("Cannot access data pointer of Tensor that doesn't have storage")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 4, requires_grad=True)
    products = torch.eye(6).reshape(6, 2, 3)
    (want,) = torch.autograd.grad(model(x), x, products, is_grads_batched=True)
    (got,) = torch.autograd.grad(wrapped(x), x, products, is_grads_batched=True)
    torch.testing.assert_close(got, want)
    jacobian = torch.autograd.functional.jacobian
    torch.testing.assert_close(jacobian(wrapped, x, vectorize=True), jacobian(model, x, vectorize=True))


class _CriticWithItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h * 2 if h.mean().item() > 0 else h  # data-dependent: graph breaks


def test_a_gradient_penalty_through_graph_breaks_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TorchDynamo's graphs cannot be differentiated twice: until wave 42 a WGAN-GP critic on that
    path got torch.compile's error alone, with no pointer to ``wrapped.module``. The warning names
    that reason alone: until wave 53 it listed every reason, a model writing into its input first."""
    monkeypatch.setattr(create_graph, "_warned", False)
    wrapped = ORTModule(_CriticWithItem())
    x = torch.randn(3, 4, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        (grad,) = torch.autograd.grad(wrapped(x).sum(), x, create_graph=True)
    assert wrapped._ortrain_graph_breaks is not None
    warnings = [r.getMessage() for r in caplog.records if "create_graph=True" in r.getMessage()]
    assert len(warnings) == 1 and "graph breaks" in warnings[0] and "wrapped.module" in warnings[0]
    assert "writes into its input" not in warnings[0]
    with pytest.raises(RuntimeError, match="double backward"):
        grad.pow(2).sum().backward()


class _DistilledStudent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(self.net(x) / 2.0, -1)
        return F.kl_div(log_p, F.softmax(teacher_logits / 2.0, -1), reduction="batchmean")


def test_an_inference_tensor_input_of_a_training_call_is_eagers() -> None:
    """A teacher's logits made under inference_mode and passed to the student: the node that makes
    a call twice differentiable saved every input, and autograd refuses to save an inference tensor
    (wave 47's review: an error at every step, or PyTorch for good under the default policy)."""
    torch.manual_seed(0)
    teacher = nn.Linear(10, 5)
    eager = _DistilledStudent()
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(2):
        x = torch.randn(8, 10)
        with torch.inference_mode():
            logits = teacher(x)
        for model in (eager, wrapped):
            model.zero_grad()
            model(x, logits).backward()
        for name, p in eager.named_parameters():
            torch.testing.assert_close(wrapped.get_parameter(name).grad, p.grad, msg=name)


def test_a_model_changed_between_forward_and_penalty_is_refused() -> None:
    # Wave 49's review: the recompute ran the model as it was at the backward: after
    # model.eval() the penalty (no dropout) was half of eager's, silently; a parameter frozen
    # in between failed with a KeyError.
    torch.manual_seed(0)
    wrapped = ORTModule(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)))
    x = torch.randn(5, 4, requires_grad=True)
    out = wrapped(x).sum()
    wrapped.eval()
    with pytest.raises(RuntimeError, match=r"model changed since that forward \(.*eval mode\)"):
        torch.autograd.grad(out, x, create_graph=True)


def _small_tanh_mlp() -> tuple[nn.Module, torch.Tensor]:
    """A float64 two-layer model and a batch for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    return model, torch.randn(5, 4, dtype=torch.float64)


def test_a_penalty_through_a_compiled_model_trains_like_eager() -> None:
    # Wave 49's review: the recompute ran torch.compile's graphs, which TorchDynamo cannot
    # differentiate twice ("does not currently support double backward").
    eager, x = _small_tanh_mlp()
    wrapped = ORTModule(torch.compile(copy.deepcopy(eager)))
    for model in (eager, wrapped):
        inputs = x.clone().requires_grad_()
        out = model(inputs).sum()
        (grad,) = torch.autograd.grad(out, inputs, create_graph=True)
        (out + grad.pow(2).sum()).backward()
    for got, expected in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


def test_an_attribute_the_loop_sets_between_forward_and_penalty_is_not_a_change() -> None:
    # The regression review: ``model.last_out = ...`` between the forward and the penalty was
    # refused as a change of the model.
    eager, x = _small_tanh_mlp()
    wrapped = ORTModule(copy.deepcopy(eager))
    for model in (eager, wrapped):
        inputs = x.clone().requires_grad_()
        out = model(inputs).sum()
        model.last_out = out.item()
        (grad,) = torch.autograd.grad(out, inputs, create_graph=True)
        grad.pow(2).sum().backward()
    for got, expected in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


@pytest.mark.parametrize("toggle", ["frozen for the penalty", "unfrozen after the forward"])
def test_requires_grad_switched_around_a_penalty_gives_eagers_gradients(toggle: str) -> None:
    # Wave 49's reviews: a discriminator weight frozen only while the penalty's gradient was taken
    # lost the penalty's part of its gradient; one frozen at the forward and unfrozen before
    # the penalty got gradients eager never gives it.
    eager, x = _small_tanh_mlp()
    wrapped = ORTModule(copy.deepcopy(eager))
    for model in (eager, wrapped):
        inputs = x.clone().requires_grad_()
        weight = model[0].weight
        weight.requires_grad_(toggle != "unfrozen after the forward")
        out = model(inputs)
        weight.requires_grad_(toggle == "unfrozen after the forward")
        (grad,) = torch.autograd.grad(out.sum(), inputs, create_graph=True)
        weight.requires_grad_(True)
        (grad.pow(2).sum() + out.mean()).backward()
    for got, expected in zip(wrapped.parameters(), eager.parameters(), strict=True):
        assert (got.grad is None) == (expected.grad is None)
        if expected.grad is not None:
            torch.testing.assert_close(got.grad, expected.grad)


class _CriticWithStatistics(nn.Module):
    """A critic that scales its input by a moving average it keeps in a buffer and replaces, and
    keeps its last features in a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 16), nn.Linear(16, 1)
        self.register_buffer("mean", torch.zeros(6))
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x * (1 + self.mean)))
        with torch.no_grad():
            self.mean = 0.5 * self.mean + 0.5 * x.mean(0)
        self.last = h.detach()
        return self.l2(h)


def test_a_penalty_through_a_forward_that_replaces_a_buffer_trains_as_in_eager() -> None:
    """The captured call returns the replaced buffer after its outputs; the recompute returned only
    the outputs, and every penalty step raised, then recomputed the penalty with the buffer's new
    value, which the input's gradient depends on: a wrong penalty, silently (wave 50's review; a
    regression of this wave, whose buffers became graph outputs)."""
    torch.manual_seed(0)
    eager = _CriticWithStatistics().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(3):
        x = torch.randn(5, 6, dtype=torch.float64)
        losses = []
        for model in (eager, wrapped):
            model.zero_grad()
            inputs = x.clone().requires_grad_()
            out = model(inputs)
            (grad,) = torch.autograd.grad(out.sum(), inputs, create_graph=True)
            loss = nn.functional.softplus(-out).mean() + 10 * grad.square().sum(1).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
        torch.testing.assert_close(wrapped.module.l1.weight.grad, eager.l1.weight.grad)
        torch.testing.assert_close(wrapped.module.mean, eager.mean)
        torch.testing.assert_close(wrapped.module.last, eager.last)
