"""ORTModule behaves as the module it wraps: state, attributes, modes, inputs and outputs."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, NamedTuple

import pytest
import torch
from _parity import ort_graph_count
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.models.tiny_gpt import GPTConfig, TinyGPT


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def test_state_is_the_wrapped_modules_own() -> None:
    inner = _mlp()
    wrapped = ORTModule(inner)
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in inner.parameters()]
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in inner.named_parameters()]
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in inner.named_buffers()]
    assert list(wrapped.state_dict()) == list(inner.state_dict())
    # A checkpoint saved with ORTModule loads without it, and the other way round.
    other = _mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    wrapped.load_state_dict(other.state_dict())
    assert torch.equal(inner[0].weight, other[0].weight)
    plain = _mlp()
    plain.load_state_dict(wrapped.state_dict())
    assert torch.equal(plain[0].weight, other[0].weight)


def test_registering_state_reaches_the_wrapped_module_and_recaptures() -> None:
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.linear(x)
            return out + self.shift if hasattr(self, "shift") else out

    inner = Shifted()
    wrapped = ORTModule(inner)
    x = torch.randn(2, 3)
    torch.testing.assert_close(wrapped(x), inner.linear(x))
    wrapped.register_buffer("shift", torch.full((3,), 5.0))
    assert "shift" in inner.state_dict() and "shift" in wrapped.state_dict()
    torch.testing.assert_close(wrapped(x), inner.linear(x) + 5.0)
    wrapped.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    wrapped.add_module("head", nn.Linear(3, 1))
    assert {"extra", "head.weight"} <= {n for n, _ in inner.named_parameters()}


def test_data_parallel_is_refused_with_advice() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ORTModule(nn.DataParallel(nn.Linear(2, 2)))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_attribute_reads_and_writes_reach_the_module_and_writes_recapture() -> None:
    inner = _Scaled()
    wrapped = ORTModule(inner)
    x = torch.randn(3, 4)
    assert wrapped.scale == 2.0
    assert wrapped.linear is inner.linear
    torch.testing.assert_close(wrapped(x), inner(x))
    wrapped.scale = 5.0
    assert inner.scale == 5.0
    torch.testing.assert_close(wrapped(x), inner.linear(x) * 5.0)
    wrapped.linear = nn.Linear(4, 4)
    assert inner.linear is wrapped.linear
    torch.testing.assert_close(wrapped(x), inner(x))


def test_train_and_eval_switch_graphs_and_no_grad_saves_nothing() -> None:
    inner = _mlp()
    eager = copy.deepcopy(inner)
    wrapped = ORTModule(inner)
    x = torch.randn(6, 8)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    wrapped.eval()
    eager.eval()
    assert not inner.training
    wrapped.zero_grad()
    eager.zero_grad()
    out = wrapped(x)
    torch.testing.assert_close(out, eager(x))  # running statistics, not batch statistics
    # eval() does not turn gradients off: an eval-mode model fine-tunes with frozen statistics.
    out.square().sum().backward()
    eager(x).square().sum().backward()
    for (name, a), b in zip(inner.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        wrapped.train()
        eager.train()
        torch.testing.assert_close(wrapped(x), eager(x))
    torch.testing.assert_close(inner[1].running_mean, eager[1].running_mean)
    graphs = wrapped._ortrain_graphs.items()
    modes = {(key.training, key.grad_enabled): group[0].capture for key, group in graphs}
    assert modes[(True, True)].backward is not None and modes[(False, True)].backward is not None
    capture = modes[(True, False)]
    assert capture.backward is None
    # An inference graph returns the user outputs and buffer updates only: nothing saved.
    outputs = capture.forward.runner.runners[0].exported.outputs
    assert len(outputs) == 1 + 3
    assert ort_graph_count(wrapped) == 3


def test_an_eval_model_gives_gradients_to_whatever_requires_them() -> None:
    """A frozen model in eval(): the gradient of its input (a saliency map, an adversarial step).
    The graph captured for eval() used to be an inference graph: the output had no grad_fn."""
    inner = _mlp().eval()
    eager = copy.deepcopy(inner)
    for p in (*inner.parameters(), *eager.parameters()):
        p.requires_grad_(False)
    wrapped = ORTModule(inner)
    x = torch.randn(6, 8)
    grads = []
    for module in (wrapped, eager):
        xi = x.clone().requires_grad_()
        module(xi).square().sum().backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_over_micro_batches() -> None:
    inner = _mlp()
    eager = copy.deepcopy(inner)
    wrapped = ORTModule(inner)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 8)
        wrapped(x).pow(2).mean().backward()
        eager(x).pow(2).mean().backward()
    for (name, a), b in zip(inner.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    extra: dict[str, torch.Tensor]


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclasses.dataclass
class Result:
    scores: torch.Tensor
    argmax: torch.Tensor
    parts: list[torch.Tensor]
    note: str


class _Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(
        self, batch: Batch, pair: Pair, *, scale: float = 1.0, use_b: bool = True, bias=None, n: int = 1
    ):
        h = self.a(batch.features) * scale + batch.extra["shift"]
        if use_b:
            h = h + self.b(pair.left + pair.right)
        if bias is not None:
            h = h + bias
        h = h * n
        return Result(scores=h, argmax=h.argmax(-1), parts=[h[:, :1], h.sum(0)], note="ok"), {"n": n}


def _structured_inputs(rows: int) -> tuple[Batch, Pair]:
    torch.manual_seed(rows)
    batch = Batch(torch.randn(rows, 4), {"shift": torch.randn(3)})
    return batch, Pair(torch.randn(rows, 4), torch.randn(rows, 4))


@pytest.mark.parametrize("kwargs", [{}, {"scale": 0.5, "use_b": False}, {"bias": torch.ones(3), "n": 3}])
def test_nested_inputs_and_outputs(kwargs: dict) -> None:
    inner = _Structured()
    eager = copy.deepcopy(inner)
    wrapped = ORTModule(inner)
    batch, pair = _structured_inputs(5)
    got, extra = wrapped(batch, pair, **kwargs)
    want, want_extra = eager(batch, pair, **kwargs)
    assert isinstance(got, Result) and got.note == "ok" and extra == want_extra
    torch.testing.assert_close(got.scores, want.scores)
    assert got.argmax.dtype == torch.int64 and torch.equal(got.argmax, want.argmax)
    assert not got.argmax.requires_grad
    torch.testing.assert_close(got.parts[1], want.parts[1])
    (got.scores.sum() + got.parts[0].sum()).backward()
    (want.scores.sum() + want.parts[0].sum()).backward()
    for a, b in zip(inner.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_hf_model_output_comes_back_as_model_output() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = ORTModule(transformers.BertForSequenceClassification(config))
    out = model(input_ids=torch.randint(0, 50, (2, 7)), labels=torch.tensor([0, 1]))
    assert type(out).__name__ == "SequenceClassifierOutput"
    assert out.loss.requires_grad and out.logits.shape == (2, 2)


def test_user_inputs_that_require_grad_receive_gradients() -> None:
    inner = _mlp()
    eager = copy.deepcopy(inner)
    wrapped = ORTModule(inner)
    x1 = torch.randn(4, 8, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    wrapped(x1).pow(2).sum().backward()
    eager(x2).pow(2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_ten_sequence_lengths_capture_at_most_twice_and_new_dtype_recaptures() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=64, n_layer=1, n_head=2, d_model=16)
    inner = TinyGPT(config)
    eager = copy.deepcopy(inner)
    wrapped = ORTModule(inner)
    for length in range(20, 30):
        idx = torch.randint(0, 50, (2, length))
        loss = wrapped(idx, idx)[1]
        torch.testing.assert_close(loss, eager(idx, idx)[1])
        loss.backward()
    # (Not ort_graph_count: over open lengths attention keeps PyTorch's kernel, see
    # test_attention_kernel.py.)
    assert sum(len(entries) for entries in wrapped._ortrain_graphs.values()) == 2
    idx = torch.randint(0, 50, (3, 25), dtype=torch.int32)
    torch.testing.assert_close(wrapped(idx, idx.long())[1], eager(idx, idx.long())[1])
    assert sum(len(entries) for entries in wrapped._ortrain_graphs.values()) == 3


def test_batch_size_change_reuses_the_dynamic_graph() -> None:
    wrapped = ORTModule(_mlp())
    for rows in (4, 6, 9, 13):
        F.mse_loss(wrapped(torch.randn(rows, 8)), torch.zeros(rows, 4)).backward()
    assert ort_graph_count(wrapped) == 2


def test_a_dynamic_graph_runs_only_inputs_its_size_assumptions_hold_for(
    truncating_model: type[nn.Module],
) -> None:
    """The dynamic graph captured at length 12 skipped the truncation; at length 20 it ran
    anyway and averaged over 20 positions where eager averages over 16: a wrong loss and wrong
    gradients, without an error. Its size guards now send length 20 to a capture of its own."""
    eager = truncating_model()
    wrapped = ORTModule(copy.deepcopy(eager))
    torch.manual_seed(1)
    for length in (8, 12, 20, 10, 24, 16):
        x = torch.randn(2, length, 4)
        losses = []
        for module in (wrapped, eager):
            module.zero_grad(set_to_none=True)
            loss = module(x)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6, msg=f"length {length}")
        for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=f"length {length}")
    assert len(wrapped._ortrain_graphs) == 3  # length 8; 9-16 (dynamic); over 16 (dynamic)


def test_torch_func_transforms_get_eager_answers_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Per-sample gradients (``vmap(grad(...))``, as differential-privacy training computes them)
    through the wrapper: functorch's wrapped tensors cannot enter a graph ("Cannot access storage
    of TensorWrapper"), so the model runs in PyTorch inside the transform, after one warning."""
    from ortrain.ortmodule import ortmodule

    ortmodule._warn_once_under_transforms.cache_clear()
    eager = _mlp().eval()
    wrapped = ORTModule(copy.deepcopy(eager)).eval()
    params = {k: v.detach() for k, v in eager.named_parameters()}
    x = torch.randn(6, 8)

    def per_sample(module: nn.Module) -> dict[str, torch.Tensor]:
        def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(module, p, (xi[None],)).square().sum()

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    with caplog.at_level(logging.WARNING, logger="ortrain.ortmodule"):
        expected, got, again = per_sample(eager), per_sample(wrapped), per_sample(wrapped)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(again[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sum("torch.func transforms" in r.getMessage() for r in caplog.records) == 1
    assert ort_graph_count(wrapped) == 0  # nothing was captured inside the transform
    torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-5, atol=1e-6)
    assert ort_graph_count(wrapped) == 1


@pytest.mark.parametrize("grad_mode", [False, True], ids=["no_grad", "grad"])
def test_forward_mode_ad_tangents_get_eager_answers_and_training_stays_on_graphs(grad_mode: bool) -> None:
    """A dual input (``torch.autograd.forward_ad``, a JVP probe) went through the captured graph
    as a plain tensor: under ``no_grad`` the output had no tangent (forward AD's zero derivative,
    silently); in grad mode ortrain's autograd Function, which has no ``jvp``, failed and sent the
    model to PyTorch for good. Such a call runs in PyTorch; the next plain call runs on the graph."""
    import torch.autograd.forward_ad as forward_ad

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    wrapped = ORTModule(copy.deepcopy(eager))
    x, tangent = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    wrapped(x).sum().backward()
    graphs = ort_graph_count(wrapped)
    assert graphs == 1
    with torch.set_grad_enabled(grad_mode), forward_ad.dual_level():
        expected = forward_ad.unpack_dual(eager(forward_ad.make_dual(x, tangent))).tangent
        got = forward_ad.unpack_dual(wrapped(forward_ad.make_dual(x, tangent))).tangent
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    out = wrapped(x)
    assert type(out.grad_fn).__name__ != "AddmmBackward0"  # still ortrain's graph, not PyTorch's
    assert ort_graph_count(wrapped) == graphs
    torch.testing.assert_close(out, eager(x), rtol=1e-12, atol=1e-12)


class _Tempered2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.temp = torch.ones(3)  # neither parameter nor buffer: bound like a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.temp


def test_a_tangent_on_a_tensor_attribute_gets_eagers_answer() -> None:
    """``model.temp = make_dual(...)``: the tangent of a plain tensor attribute went unseen (the
    check read inputs, parameters and buffers), and the output had no tangent (wave 46)."""
    import torch.autograd.forward_ad as forward_ad

    torch.manual_seed(0)
    eager = _Tempered2().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 4, dtype=torch.float64)
    wrapped(x).sum().backward()
    tangent = torch.randn(3, dtype=torch.float64)
    with torch.no_grad(), forward_ad.dual_level():
        answers = []
        for m in (eager, wrapped):
            m.temp = forward_ad.make_dual(torch.ones(3, dtype=torch.float64), tangent)
            answers.append(forward_ad.unpack_dual(m(x)).tangent)
    assert answers[1] is not None
    torch.testing.assert_close(answers[1], answers[0])


def test_code_writing_the_module_tables_through_the_wrapper_changes_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``prepare_qat(wrapped)`` swaps submodules with ``module._modules[name] = ...``: written into
    the wrapper's own table, the model trained without weight fake-quant, silently (a loss 4e-3
    off eager's), and ``convert`` left float layers (wave 46's review). The tables are the model's."""
    import torch.ao.quantization as quantization

    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the default: the fake-quant op runs in PyTorch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    for m in (eager, wrapped):
        m.train()
        m.qconfig = quantization.get_default_qat_qconfig("qnnpack")
        quantization.prepare_qat(m, inplace=True)
    assert type(wrapped.module[0]) is type(eager[0]) is torch.ao.nn.qat.Linear
    assert wrapped._modules is model._modules and list(wrapped.state_dict()) == list(eager.state_dict())
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        losses = []
        for m in (eager, wrapped):
            m.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6), step
    converted = quantization.convert(wrapped.eval(), inplace=False)
    assert type(converted.module[0]) is torch.ao.nn.quantized.Linear


def test_a_parametrization_of_the_roots_own_tensor_through_the_wrapper_is_refused_untouched() -> None:
    """``register_parametrization(wrapped, "weight", ...)`` would move the weight out of the model
    and put its property on the wrapper's class: refused before anything moved."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    model = nn.Linear(4, 2)
    wrapped = ORTModule(model)
    with pytest.raises(TypeError, match=r"register_parametrization\(wrapped.module, 'weight'"):
        parametrize.register_parametrization(wrapped, "weight", Double())
    assert list(model.state_dict()) == ["weight", "bias"] and isinstance(model.weight, nn.Parameter)
    parametrize.register_parametrization(wrapped.module, "weight", Double())  # the advice works
    x = torch.randn(3, 4)
    torch.testing.assert_close(wrapped(x), x @ (2 * model.parametrizations.weight.original).t() + model.bias)


def test_a_wrapped_container_indexes_iterates_and_takes_a_new_head() -> None:
    """``model[-1]``, ``len(model)``, ``for layer in model``, ``"k" in model`` reach the wrapped
    Sequential or ModuleDict (they raised "object is not subscriptable"); writing an item drops
    the captured graphs and trains the new item."""
    inner = _mlp()
    eager = copy.deepcopy(inner)
    wrapped = ORTModule(inner)
    assert wrapped[0] is inner[0] and wrapped[-1] is inner[-1] and len(wrapped) == len(inner) == 4
    assert list(wrapped) == list(inner) and list(reversed(wrapped)) == list(reversed(inner))
    assert isinstance(wrapped[1:], nn.Sequential) and len(wrapped[1:]) == 3
    x = torch.randn(5, 8)
    torch.testing.assert_close(wrapped(x), eager(x))
    torch.manual_seed(3)
    head = nn.Linear(16, 2)
    wrapped[-1], eager[-1] = head, copy.deepcopy(head)
    assert ort_graph_count(wrapped) == 0  # dropped with the old head
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    torch.testing.assert_close(wrapped[-1].weight.grad, eager[-1].weight.grad)

    layers = ORTModule(nn.ModuleDict({"a": nn.Linear(2, 2)}))
    assert "a" in layers and layers["a"] is layers.module["a"] and list(layers) == ["a"]
    with pytest.raises(TypeError, match="not subscriptable"):
        ORTModule(nn.Linear(2, 2))[0]  # a module that is no container stays none


class _Parent(nn.Module):
    def __init__(self, wrap: bool) -> None:
        super().__init__()
        encoder = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.encoder = ORTModule(encoder) if wrap else encoder
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_a_parent_loads_a_state_dict_into_its_wrapped_child() -> None:
    """The parent's walk met the wrapper's empty tables: every encoder key was 'unexpected', and
    strict=False loaded nothing without a word."""
    torch.manual_seed(0)
    saved = _Parent(wrap=False).state_dict()
    for strict in (True, False):
        torch.manual_seed(1)
        parent = _Parent(wrap=True)
        assert list(parent.state_dict()) == list(saved)
        result = parent.load_state_dict(saved, strict=strict)
        assert not result.missing_keys and not result.unexpected_keys
        for key, value in parent.state_dict().items():
            assert torch.equal(value, saved[key]), key
    partial = {k: v for k, v in saved.items() if k != "encoder.0.bias"}
    partial["encoder.0.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"encoder\.0\.bias"'):
        _Parent(wrap=True).load_state_dict(partial)
    result = _Parent(wrap=True).load_state_dict(partial, strict=False)
    assert result.missing_keys == ["encoder.0.bias"] and result.unexpected_keys == ["encoder.0.extra"]


def test_a_rebound_table_and_the_models_post_hooks_are_the_models_in_a_parents_load() -> None:
    """The wrapper's tables are read from the model at each access: one the model rebinds
    (``_modules = OrderedDict(...)``) left a shared copy stale, and a parent's load filled the old
    submodules; a post hook registered on the model met the wrapper as its module (wave 46)."""
    from collections import OrderedDict

    torch.manual_seed(0)
    parent = _Parent(wrap=True)
    encoder = parent.encoder.module
    new_layers = OrderedDict([("0", nn.Linear(4, 4)), ("1", nn.BatchNorm1d(4))])
    encoder._modules = new_layers
    assert parent.encoder._modules is new_layers
    modules_seen = []
    encoder.register_load_state_dict_post_hook(lambda module, keys: modules_seen.append(module))
    saved = {
        k: torch.full_like(v, 7.0) if v.is_floating_point() else v for k, v in parent.state_dict().items()
    }
    result = parent.load_state_dict(saved)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(new_layers["0"].weight, torch.full((4, 4), 7.0))
    assert modules_seen == [encoder]


def test_apply_reaches_the_wrapped_model_itself() -> None:
    """``apply`` called ``fn`` on the wrapper, not on the model: an init keyed on the model's class
    (its own parameters) was skipped."""
    wrapped = ORTModule(_Scaled())
    seen: list[type] = []
    assert wrapped.apply(lambda m: seen.append(type(m))) is wrapped
    assert seen == [nn.Linear, _Scaled]


def test_code_that_wraps_the_wrapper_keeps_its_changes_on_the_wrapper() -> None:
    """accelerate's mixed precision (the HF Trainer's bf16=True) sets an instance ``forward`` on the
    model it prepares, and ``register_full_backward_hook`` sets a flag: passed to the wrapped
    module, the first made it call the wrapper again (a capture recursing until the process
    crashed), the second left the wrapper's backward hook unread (never called)."""
    torch.manual_seed(0)
    inner = nn.Linear(4, 2)
    wrapped = ORTModule(inner)
    original = wrapped.forward
    wrapped.forward = lambda *args, **kwargs: original(*args, **kwargs) * 2  # type: ignore[method-assign]
    calls = []
    wrapped.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(grad_out[0].shape))
    x = torch.randn(3, 4)
    for _ in range(3):
        out = wrapped(x)
        out.sum().backward()
    torch.testing.assert_close(out, inner(x) * 2)
    assert "forward" not in vars(inner) and calls == [torch.Size([3, 2])] * 3


def test_a_backward_hook_on_a_submodule_runs_at_every_backward() -> None:
    """A graph traced with it ran the hook once, while tracing, on a FunctionalTensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    seen: list[type] = []
    model[2].register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(type(grad_out[0])))
    wrapped = ORTModule(model)
    for _ in range(3):
        wrapped(torch.randn(3, 4)).sum().backward()
    assert seen == [torch.Tensor] * 3


class _MultiLabel(nn.Module):
    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)
        self.breaks = breaks

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        scores = self.linear(x)
        if self.breaks:  # a Python number from a tensor: TorchDynamo's graph-break path
            scores = scores / max(float(scores.detach().abs().amax()), 1.0)
        return F.multilabel_margin_loss(scores, target)


@pytest.mark.parametrize("breaks", [False, True], ids=["whole", "graph breaks"])
def test_multilabel_margin_loss_with_ended_target_lists_trains_like_eager(breaks: bool) -> None:
    """Wave 34: PyTorch's decomposition, which captures ran, counted the slots after a target
    list's -1 as class 0 (torch.compile too): the loss was 2.6 where eager's was 0.8."""
    torch.manual_seed(0)
    eager = _MultiLabel(breaks)
    wrapped = ORTModule(copy.deepcopy(eager))
    target = torch.tensor([[0, 3, -1, 0, 0], [4, -1, 1, 1, 1], [2, 1, 0, 3, 4]])
    for step in range(3):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
        losses = []
        for model in (eager, wrapped):
            model.zero_grad()
            loss = model(x, target)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
        for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)


class _MarginLosses(nn.Module):
    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.breaks = breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x * self.scale
        if self.breaks:  # a Python number from a tensor: TorchDynamo's graph-break path
            scores = scores * (1.0 if float(scores.detach().amax()) < 100 else 0.5)
        multi_label = F.multilabel_margin_loss(scores, torch.tensor([[1, -1, 0, 0], [2, 0, -1, 0]]))
        return F.multi_margin_loss(scores, torch.tensor([1, 2])) + 2 * multi_label


@pytest.mark.parametrize("breaks", [False, True], ids=["whole", "graph breaks"])
def test_margin_losses_take_no_gradient_at_a_zero_hinge(breaks: bool) -> None:
    """Wave 37: a score exactly the margin below its target's (whole-number scores) took a gradient
    through the captured clamp_min where PyTorch's kernels give none: the target's score had a
    gradient a third larger than eager's."""
    eager = _MarginLosses(breaks)
    wrapped = ORTModule(copy.deepcopy(eager))
    scores = [[1.0, 1.0, 0.0, 1.0], [2.0, 0.5, 1.0, 1.0]]
    inputs = [torch.tensor(scores, requires_grad=True) for _ in range(2)]
    losses = [model(x) for model, x in zip((eager, wrapped), inputs, strict=True)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad)
    torch.testing.assert_close(wrapped.module.scale.grad, eager.scale.grad)
    assert inputs[0].grad[0, 2] == 0


def test_state_dict_hooks_registered_on_the_wrapper_run() -> None:
    """The state dict is the wrapped module's: until wave 42 hooks registered on the wrapper never ran."""
    model = ORTModule(nn.Linear(2, 2))
    fired: list[str] = []

    def add_entry(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        fired.append("post")
        state[prefix + "extra"] = torch.tensor(1.0)

    def drop_entry(module: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
        fired.append("load pre")
        state.pop(prefix + "extra", None)

    model.register_state_dict_pre_hook(lambda *args: fired.append("pre"))
    model.register_state_dict_post_hook(add_entry)
    model.register_load_state_dict_pre_hook(drop_entry)
    model.register_load_state_dict_post_hook(lambda *args: fired.append("load post"))
    state = model.state_dict()
    assert "extra" in state
    model.load_state_dict(state)
    assert fired == ["pre", "post", "load pre", "load post"]


class _BranchesOnTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h * 2 if self.training else h).square().mean()


def test_the_training_flag_set_or_read_through_the_wrapper_is_the_models() -> None:
    """Until wave 44 the wrapper kept a flag of its own: `wrapped.training = False` left the
    model training (its branch on `self.training` took the training path, 4x eager's loss)."""
    torch.manual_seed(0)
    eager = _BranchesOnTraining()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    eager.training = False
    wrapped.training = False
    assert wrapped.module.training is False
    torch.testing.assert_close(wrapped(x), eager(x))
    wrapped.module.train()
    assert wrapped.training is True
    wrapped.eval()
    assert wrapped.training is False and wrapped.module.training is False
    assert copy.deepcopy(wrapped).training is False


@pytest.mark.parametrize("bad", ["numpy", "meta"])
def test_an_input_eager_rejects_too_raises_eagers_error_and_keeps_the_graphs(bad: str) -> None:
    """A NumPy array or a tensor on another device: until wave 44 ortrain's own input or device
    error sent the model to PyTorch for good (under the default policy) before PyTorch's error."""
    import numpy as np

    torch.manual_seed(0)
    wrapped = ORTModule(_mlp())
    x = torch.randn(3, 8)
    wrapped(x).sum().backward()
    graphs = ort_graph_count(wrapped)
    batch = np.ones((3, 8), np.float32) if bad == "numpy" else torch.ones(3, 8, device="meta")
    with pytest.raises((TypeError, RuntimeError)) as raised:
        wrapped(batch)
    assert type(raised.value) in (TypeError, RuntimeError)  # PyTorch's, not an ORTModule error
    wrapped(x).sum().backward()
    assert not wrapped._ortrain_fallback.active and ort_graph_count(wrapped) == graphs


class _CountsItsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x.to_dense() if x.layout != torch.strided else x).sum()


def test_an_input_eager_accepts_but_ortrain_refuses_runs_the_forward_once(monkeypatch) -> None:
    """A sparse CSR input: PyTorch trains the model (one warning), and the call runs its Python
    once (wave 44's first eager check before the fallback ran it twice: a step counter one ahead
    of eager's for good)."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the default policy lets PyTorch take over
    wrapped = ORTModule(_CountsItsCalls())
    dense = torch.randn(3, 8)
    dense[dense.abs() < 0.8] = 0
    wrapped(dense.to_sparse_csr()).backward()
    assert wrapped.calls == 1 and wrapped._ortrain_fallback.active


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.temp = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) / self.temp).square().mean()


def test_the_same_value_set_again_through_the_wrapper_keeps_the_graphs() -> None:
    """A loop's `model.temp = 1.5` at every step dropped every graph until wave 44 (a capture per
    step); another value got a graph of its own, and going back found the first (until wave 46
    every other value dropped them all)."""
    eager = _Tempered()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    runners = set()
    for temp in (1.5, 1.5, 1.5, 2.0, 1.5, 2.0):
        wrapped.temp = eager.temp = temp
        torch.testing.assert_close(wrapped(x), eager(x))
        wrapped(x).backward()
        runners |= {id(runner) for _, runner in wrapped.graph_runners()}
    assert len(runners) == 4  # a forward and a backward per value: each captured once
    assert ort_graph_count(wrapped) == 2


def test_a_capture_after_a_change_through_the_wrapper_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Until wave 53 it said "first call": the change had dropped every graph, and with them the
    graph used last that the reason is found against."""
    wrapped = ORTModule(_Tempered())
    x = torch.randn(3, 4)
    wrapped.scale = 1.5  # before any graph: still the first call
    with caplog.at_level(logging.INFO, logger="ortrain.ortmodule"):
        wrapped(x).backward()
        wrapped.momentum = 0.9  # a new attribute: every graph dropped
        wrapped(x).backward()
        wrapped.register_buffer("offset", torch.zeros(4))
        wrapped(x).backward()
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    assert reasons == [
        "capturing a graph: first call",
        "capturing a graph: attribute 'momentum' was set through the ORTModule",
        "capturing a graph: buffer 'offset' was registered through the ORTModule",
    ]
