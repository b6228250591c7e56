"""Outputs of every structure PyTorch returns, and values ortrain cannot pass, through ORTModule."""

from __future__ import annotations

import copy
import logging
from typing import Any, NamedTuple

import pytest
import torch
from _parity import assert_same_state, ort_graph_count, train_side_by_side
from torch import nn

from ortrain.ortmodule import ORTModule, ORTModuleIOError


class Pair(NamedTuple):
    values: torch.Tensor
    order: torch.return_types.sort


class Reductions(nn.Module):
    """Returns torch.return_types structures, a named tuple holding one, and nests them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.linear(x)
        return {
            "min": torch.min(h, dim=0),
            "max": h.max(dim=1, keepdim=True),
            "top": [torch.topk(h, 2), torch.kthvalue(h, 2, dim=1)],
            "pair": Pair(h.sum(0), torch.sort(h, dim=1)),
            "mode": torch.mode(h.round(), dim=0),
        }


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    assert type(out["min"]) is torch.return_types.min
    assert type(out["max"]) is torch.return_types.max
    assert type(out["top"][0]) is torch.return_types.topk
    assert type(out["top"][1]) is torch.return_types.kthvalue
    assert type(out["pair"]) is Pair and type(out["pair"].order) is torch.return_types.sort
    assert type(out["mode"]) is torch.return_types.mode
    assert out["min"].indices.dtype == torch.int64 and not out["min"].indices.requires_grad
    return (
        out["min"].values.sum()
        + (out["max"].values * 2).sum()
        + out["top"][0].values.pow(2).sum()
        + out["top"][1].values.sum()
        + out["pair"].values.sum()
        + out["pair"].order.values[:, 0].sum()
    )


def test_return_types_train_with_parity_under_fallback_disable() -> None:
    torch.manual_seed(0)
    batches = [torch.randn(5, 6) for _ in range(3)]
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(Reductions(), batches, _loss)
    assert ort_graph_count(wrapped) == 1
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-5)
    assert_same_state(wrapped, eager)


class _OpaqueOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        return self.linear(x), object()


class _OpaqueInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, batch: dict[str, object]) -> torch.Tensor:
        return self.linear(x)


def test_unsupported_output_raises_io_error_naming_it_under_fallback_disable() -> None:
    with pytest.raises(ORTModuleIOError, match=r"output \[1\] \(a object\)") as raised:
        ORTModule(_OpaqueOutput())(torch.randn(2, 4))
    assert type(raised.value) is ORTModuleIOError  # not wrapped in a TorchModelException


def test_unsupported_input_raises_io_error_naming_it_under_fallback_disable() -> None:
    with pytest.raises(ORTModuleIOError, match=r"input 'batch\.mask' \(a object\)"):
        ORTModule(_OpaqueInput())(torch.randn(2, 4), batch={"mask": object()})


@pytest.mark.parametrize("policy", ["FALLBACK_UNSUPPORTED_DATA", None])
def test_unsupported_output_falls_back_to_pytorch_with_one_warning(
    policy: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if policy is None:
        monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")  # the default policy
    else:
        monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", policy)
    torch.manual_seed(0)
    module = _OpaqueOutput()
    model = ORTModule(module)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(2):
            out, extra = model(x)
            out.sum().backward()
    torch.testing.assert_close(out, module.linear(x))
    assert isinstance(extra, object)
    warnings = [r for r in caplog.records if "trains it in PyTorch instead" in r.getMessage()]
    assert len(warnings) == 1 and "output [1]" in warnings[0].getMessage()


def test_unsupported_output_is_refused_when_only_model_fallback_is_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_TORCH_MODEL")
    with pytest.raises(ORTModuleIOError):
        ORTModule(_OpaqueOutput())(torch.randn(2, 4))


class _StableSort(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(7))

    def forward(self, x: torch.Tensor) -> tuple[torch.return_types.sort, torch.return_types.sort]:
        h = x * self.scale
        return torch.sort(h, dim=1, stable=True), torch.sort(h, dim=1, stable=True, descending=True)


def test_stable_sort_keeps_ties_in_order_in_onnxruntime() -> None:
    x = torch.tensor([[3.0, 1.0, 3.0, 1.0, 2.0, 1.0, 3.0], [2.0, 5.0, 2.0, 5.0, 7.0, 0.0, 0.0]])
    module = _StableSort()
    ascending, descending = ORTModule(module)(x)
    want_ascending, want_descending = _StableSort()(x)
    for got, want in ((ascending, want_ascending), (descending, want_descending)):
        assert type(got) is torch.return_types.sort
        assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    (ascending.values[:, :2].sum() + descending.values[:, 0].sum()).backward()
    reference = _StableSort()
    a, d = reference(x)
    (a.values[:, :2].sum() + d.values[:, 0].sum()).backward()
    torch.testing.assert_close(module.scale.grad, reference.scale.grad)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.main = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.main(h), self.aux(h)


@pytest.mark.parametrize("tuning", ["0", "1"])
def test_a_head_the_loss_does_not_use_gets_no_gradient(monkeypatch: pytest.MonkeyPatch, tuning: str) -> None:
    """Eager leaves ``.grad`` None on an auxiliary head the loss does not use; the captured backward
    made zeros, which AdamW's weight decay and momentum then moved. Steps that use it and steps
    that do not alternate, under ONNX Runtime (tuning off) and PyTorch's first calls (tuning on)."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", tuning)
    eager, model = _TwoHeads(), _TwoHeads()
    wrapped = ORTModule(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (wrapped, eager)]
    torch.manual_seed(1)
    for step in range(5):
        x = torch.randn(4, 8)
        uses_aux = step in (2, 3)
        for module, optimizer in zip((wrapped, eager), optimizers, strict=True):
            main, aux = module(x)
            loss = main.square().mean() + (aux.square().mean() if uses_aux else 0)
            loss.backward()
            assert (module.aux.weight.grad is None) == (not uses_aux)
            assert module.main.weight.grad is not None
            optimizer.step()
            optimizer.zero_grad()
        assert_same_state(wrapped, eager)


class _ReturnsSizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"loss": self.linear(x).sum() / x.shape[0], "rows": x.shape[0] * 2, "half": x.shape[0] / 2}


def test_numbers_computed_from_a_dynamic_size_come_back_as_numbers(caplog: pytest.LogCaptureFixture) -> None:
    """A graph captured for any batch size computes ``x.shape[0] * 2`` from the size it is given:
    such an output was refused (a SymInt cannot leave the graph) and the model fell back to
    PyTorch for good. It now comes back as the number eager returns, for every batch size."""
    torch.manual_seed(0)
    eager = _ReturnsSizes()
    wrapped = ORTModule(_ReturnsSizes())
    wrapped.load_state_dict(eager.state_dict())
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for rows in (2, 3, 5, 7):  # the second size makes the graph dynamic
            x = torch.randn(rows, 4)
            got, want = wrapped(x), eager(x)
            assert (got["rows"], got["half"]) == (want["rows"], want["half"])
            assert type(got["rows"]) is int and type(got["half"]) is float
            torch.testing.assert_close(got["loss"], want["loss"])
            got["loss"].backward()
            want["loss"].backward()
    for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert ort_graph_count(wrapped) == 2  # static, then dynamic: nothing ran in PyTorch
    assert not caplog.records


class _ViewsOfOutputs(nn.Module):
    """Returns the logits, views of them and the same tensor twice (a pooled first row next to
    the sequence, a transposed copy for a second loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.linear(x)
        return {"logits": h, "first": h[:, :2], "t": h.t(), "row": h[0], "again": h}


@pytest.mark.parametrize(
    "write",
    [
        lambda out: out["first"].mul_(2.0),
        lambda out: out["t"][1].clamp_(max=0.1),
        lambda out: out["row"].div_(3.0),
        lambda out: out["again"].mul_(0.5),
    ],
    ids=["slice", "transpose", "row", "same tensor"],
)
def test_writing_into_a_view_of_another_output_reaches_it_as_eagerly(write: Any) -> None:
    """In eager PyTorch an output that is a view of another shares its autograd history: writing
    into it changes the other and its gradient. Until wave 36 ORTModule's outputs shared memory but
    not history, and the gradient missed the write, silently."""
    torch.manual_seed(0)
    model = _ViewsOfOutputs()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(4, 6)
    for step in range(2):
        losses = []
        for m in (model, wrapped):
            out = m(x)
            write(out)
            loss = out["logits"].square().sum() + out["first"].exp().sum()
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6), f"step {step}"
        for p, q in zip(model.parameters(), wrapped.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
            p.grad = q.grad = None


def test_output_aliases_names_views_and_repeats_only() -> None:
    """A copy, a detached view (no history to share) and a view of a tensor no output holds are
    left alone; a repeat, a view and a transposed view of an output are made again from it."""
    from ortrain.ortmodule.output_aliases import output_aliases

    base = torch.randn(4, 6, requires_grad=True)
    h = base * 2
    hidden = base * 3
    outputs = [h, h.clone(), h.detach(), h[:, 1:3], h, h.t(), hidden[0], 5]
    aliases = output_aliases(outputs)
    assert sorted(aliases) == [3, 4, 5]
    assert aliases[4] == (0, None)
    assert aliases[3] == (0, (torch.Size([4, 2]), (6, 1), 1))
    assert aliases[5][0] == 0


class _ReturnsItsTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x * 1), x, x[0], self.linear.weight


@pytest.mark.parametrize("written", ["returned input", "input", "returned row"])
def test_outputs_that_are_inputs_or_parameters_are_them_with_their_history(written: str) -> None:
    """Until wave 42 such outputs shared the input's memory but not its history: a write into one
    reached the values and not the gradient of whatever made the input (an embedding's gradient 2x
    off), and a returned parameter was a non-leaf that accepted in-place writes."""
    torch.manual_seed(0)
    embedding, block = nn.Embedding(10, 4), _ReturnsItsTensors()
    twin_embedding, wrapped = copy.deepcopy(embedding), ORTModule(copy.deepcopy(block))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for step in range(2):
        grads = []
        for emb, model in ((embedding, block), (twin_embedding, wrapped)):
            x = emb(ids)
            h, returned, row, weight = model(x)
            assert returned is x and row._base is x and weight is model.linear.weight
            with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
                weight.mul_(0.5)
            target = {"returned input": returned, "input": x, "returned row": row}[written]
            target.mul_(2)
            loss = h.square().sum() + returned.square().sum() + row.sum() * 3 + x.sum()
            loss.backward()
            grads.append(emb.weight.grad.clone())
            emb.zero_grad()
        torch.testing.assert_close(grads[1], grads[0], msg=f"step {step}")


class _ReturnsDetachedInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x), x.detach(), self.linear.weight.detach()[0]


def test_detached_views_of_inputs_stay_detached() -> None:
    wrapped = ORTModule(_ReturnsDetachedInputs())
    x = torch.randn(3, 4, requires_grad=True)
    _, detached, row = wrapped(x)
    assert not detached.requires_grad and not row.requires_grad
    assert detached.data_ptr() == x.data_ptr() and row.data_ptr() == wrapped.linear.weight.data_ptr()


class _ReturnsItsSecondInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(a), b


def test_an_output_that_is_one_of_two_inputs_over_one_storage_is_that_input() -> None:
    """``m(base[:, :4], base[:, 4:])`` returning ``b``: wave 42's first fix made it a view of ``a``
    (the first tensor over that storage), and the gradient of ``b``'s half was lost."""
    torch.manual_seed(0)
    model = _ReturnsItsSecondInput()
    wrapped = ORTModule(copy.deepcopy(model))
    grads = []
    for m in (model, wrapped):
        leaf = torch.arange(24.0).view(3, 8).requires_grad_()
        base = leaf * 1
        a, b = base[:, :4], base[:, 4:]
        h, returned = m(a, b)
        assert returned is b or returned.data_ptr() == b.data_ptr()
        (h.sum() + (returned * torch.arange(4.0)).sum()).backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0])


class _ReturnsAnExpandedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), self.bias[2:].expand(x.shape[0], 4)


@pytest.mark.parametrize("wrap", ["ORTModule", "torch.compile"])
def test_an_expanded_parameter_returned_at_a_new_batch_size_is_a_view_of_it(wrap: str) -> None:
    """Until wave 43 AOTAutograd remade such an output with ONNX Runtime's contiguous strides,
    past the parameter's end: the second (dynamic) capture failed and the model fell back."""
    torch.manual_seed(0)
    model = _ReturnsAnExpandedParameter()
    twin = copy.deepcopy(model)
    wrapped = ORTModule(twin) if wrap == "ORTModule" else torch.compile(twin, backend="ortrain")
    for batch in (3, 5, 7):
        x = torch.randn(batch, 4)
        weights = torch.arange(float(batch))[:, None]
        outputs = []
        for m in (model, wrapped):
            h, expanded = m(x)
            assert expanded.stride() == (0, 1) and expanded.storage_offset() == 2
            (h.sum() + (expanded * weights).sum()).backward()
            outputs.append(expanded)
        torch.testing.assert_close(outputs[1], outputs[0])
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, msg=f"batch {batch}")


class _ReturnsAnExpandedRowOfItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        return self.linear(x), x[:, :1].expand(b, s, d)


def test_an_expanded_row_of_the_input_at_new_sizes_is_that_view() -> None:
    """Its strides are symbolic at the dynamic capture: AOTAutograd remade it from the input with
    ONNX Runtime's contiguous strides, so until wave 43 it came back as the input itself (loss
    0.117 against eager's 0.835), silently; PyTorch now makes the view on the call's input."""
    torch.manual_seed(0)
    model = _ReturnsAnExpandedRowOfItsInput()
    wrapped = ORTModule(copy.deepcopy(model))
    for b, s in [(2, 5), (3, 7), (2, 4)]:
        x = torch.randn(b, s, 8)
        results = []
        for m in (model, wrapped):
            leaf = x.clone().requires_grad_()
            h, first = m(leaf)
            loss = h.square().mean() + (first * torch.arange(s).view(1, s, 1)).mean()
            loss.backward()
            results.append((loss, first, leaf.grad))
        (want, want_first, want_grad), (got, got_first, got_grad) = results
        assert got_first.stride() == want_first.stride()
        torch.testing.assert_close(got_first, want_first)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)


class _ReturnsComplexViews(nn.Module):
    """Views that change the dtype or carry a lazy conj/neg bit, of a parameter, an input and an
    output: ``as_strided`` with their layout alone gave ``w`` for ``w.conj()`` (a loss of the wrong
    sign), float32 for ``view_as_complex(x)``, and lost ``z.real``'s history (wave 51's review)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j, -0.5 + 0.25j]))
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, c: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = torch.fft.fft(self.linear(x)) * self.w
        return (
            self.w.conj(),
            self.w.unsqueeze(0).mH,
            self.w.conj().imag,
            self.w.real,
            c.conj(),
            torch.view_as_complex(pairs),
            z,
            z.real,
            z.imag,
        )


def _complex_views_loss(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    weights = iter(range(1, 100))
    total = torch.zeros(())
    for t in outputs:
        values = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t.resolve_neg()
        total = total + (values * next(weights)).sum()
    return total


def test_complex_views_of_parameters_inputs_and_outputs_keep_their_dtype_bits_and_history() -> None:
    torch.manual_seed(0)
    eager = _ReturnsComplexViews()
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(2):
        x, c, pairs = (
            torch.randn(2, 3),
            torch.complex(torch.randn(2, 3), torch.randn(2, 3)),
            torch.randn(3, 2),
        )
        grads = []
        for model in (eager, wrapped):
            cs, ps = c.clone().requires_grad_(), pairs.clone().requires_grad_()
            outputs = model(x, cs, ps)
            assert outputs[7]._base is outputs[6]  # z.real is a view of z, as in eager
            outputs[6].mul_(2)  # reaches z.real and z.imag, values and gradients
            _complex_views_loss(outputs).backward()
            grads.append([cs.grad, ps.grad, *(p.grad.clone() for p in model.parameters())])
            got = [(t.dtype, t.is_conj(), t.is_neg(), t.resolve_conj().resolve_neg()) for t in outputs]
            if model is eager:
                expected = got
            model.zero_grad()
        for (dtype, conj, neg, value), (e_dtype, e_conj, e_neg, e_value) in zip(got, expected, strict=True):
            assert (dtype, conj, neg) == (e_dtype, e_conj, e_neg)
            torch.testing.assert_close(value, e_value)
        for g, e in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(g, e)
