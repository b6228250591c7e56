"""Functions reached any way run as python ops; plain tensor attributes are captured and followed."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn
from torch.nn import functional as F

from ortrain import DebugOptions, LogLevel, ORTModule
from ortrain.capture.apply_hook import original_apply
from ortrain.capture.python_ops import iter_python_op_nodes, lookup_call, python_op

CALLS = {"forward": 0, "backward": 0}


class ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:  # type: ignore[override]
        CALLS["forward"] += 1
        y = torch.tanh(x) * k
        ctx.save_for_backward(y)
        ctx.k = k
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        CALLS["backward"] += 1
        (y,) = ctx.saved_tensors
        return g * (ctx.k - y * y / ctx.k), None


class ScaledTanhSubclass(ScaledTanh):
    pass


scaled_tanh = ScaledTanh.apply  # a module-level alias, bound at import


class EarlyBound(nn.Module):
    """Each Function reached another way: bound in __init__, alias, partial, subclass."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.fn = ScaledTanh.apply  # Megatron's idiom
        self.half = functools.partial(ScaledTanh.apply, k=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fn(self.a(x), 2.0)
        h = scaled_tanh(h, 1.5)
        h = self.half(h)
        h = ScaledTanhSubclass.apply(h, 1.0)
        return self.b(h)


def _python_op_names(model: ORTModule) -> tuple[list[str], list[str]]:
    (entry,) = [e for entries in model._ortrain_graphs.values() for e in entries]
    names = []
    for slot in (entry.capture.forward, entry.capture.backward):
        nodes = iter_python_op_nodes(slot.graph.graph)
        # python_op(inputs, call_id); python_op_grad(handle, grad_outputs, call_id, sizes)
        names.append(
            [lookup_call(n.args[1] if n.target is python_op else n.args[2]).func_name for n in nodes]
        )
    return names[0], names[1]


def test_early_bound_aliased_partial_and_subclass_functions_are_python_ops() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(3)]
    model = EarlyBound()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    loss_fn = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    loss_fn(wrapped, batches[0]).backward()  # capture
    forward_ops, backward_ops = _python_op_names(wrapped)
    base = f"{__name__}.ScaledTanh"
    assert forward_ops == [base, base, base, f"{__name__}.ScaledTanhSubclass"]
    assert len(backward_ops) == 4
    # At training time each Function's own forward and backward run, once per call per step.
    before = dict(CALLS)
    for batch in batches[1:]:
        loss_fn(wrapped, batch).backward()
    assert CALLS["forward"] - before["forward"] == 4 * 2
    assert CALLS["backward"] - before["backward"] == 4 * 2
    for batch in batches:
        loss_fn(eager, batch).backward()
    for p_ort, p_eager in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p_ort.grad, p_eager.grad, rtol=1e-4, atol=1e-6)


def test_function_apply_is_restored_after_capture() -> None:
    apply = torch.autograd.Function.__dict__["apply"].__func__
    code = apply.__code__
    wrapped = ORTModule(EarlyBound())
    wrapped(torch.randn(2, 6)).sum().backward()
    assert apply.__code__ is code is original_apply.__code__
    assert "_ortrain_apply_hook" not in vars(torch.autograd.function)
    # The bound method taken before the capture runs the real Function again, eagerly.
    before = CALLS["forward"]
    wrapped.module.fn(torch.randn(2, 6, requires_grad=True), 2.0).sum().backward()
    assert CALLS["forward"] == before + 1


def test_functions_are_traced_when_custom_autograd_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0")
    torch.manual_seed(0)
    wrapped = ORTModule(EarlyBound())
    wrapped(torch.randn(2, 6)).sum().backward()
    assert _python_op_names(wrapped) == ([], [])


# ---- tensor attributes ---------------------------------------------------------------------------
class WithTensorAttributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.scale = torch.linspace(0.5, 1.5, 5)  # not a buffer
        self.inner = nn.Module()
        self.inner.offset = torch.tensor(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.inner.offset


def test_tensor_attributes_train_with_parity_and_module_is_restored() -> None:
    torch.manual_seed(0)
    model = WithTensorAttributes()
    scale = model.scale
    batches = [(torch.randn(3, 5), torch.randn(3, 5)) for _ in range(4)]
    loss_fn = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, loss_fn)
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=1e-7)
    assert_same_state(wrapped, eager)
    assert model.scale is scale and "scale" not in model._buffers and "offset" not in model.inner._buffers
    assert set(model.state_dict()) == {"lin.weight", "lin.bias"}
    assert len(wrapped._ortrain_graphs) == 1


class _ScaleAndShift(nn.Module):
    """Two tensor attributes of one module, of one shape: bound in the wrong order they give a
    plausible, wrong answer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.scale = torch.full((5,), 2.0)
        self.note = "between them"
        self.shift = torch.full((5,), -1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.shift


def test_several_tensor_attributes_of_a_module_keep_their_order_and_their_values() -> None:
    """The capture put them back in reverse order, and the step's state (read before the
    capture, in attribute order) was bound by the order after it: every step read ``scale`` as
    ``shift`` and the reverse, silently (a loss 5.44 for eager's 3.00)."""
    torch.manual_seed(0)
    model = _ScaleAndShift()
    order = list(model.__dict__)
    batches = [(torch.randn(3, 5), torch.randn(3, 5)) for _ in range(3)]
    loss_fn = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, loss_fn)
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=1e-7)
    assert_same_state(wrapped, eager)
    assert list(model.__dict__) == order
    assert len(wrapped._ortrain_graphs) == 1


def test_changed_tensor_attribute_is_seen(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = WithTensorAttributes()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model, DebugOptions(log_level=LogLevel.INFO))
    x = torch.randn(3, 5)
    torch.testing.assert_close(wrapped(x), eager(x))
    # New values, same shape: bound as an input, no new capture.
    for m in (model, eager):
        m.scale = torch.full((5,), 3.0)
        m.inner.offset = torch.tensor(-1.0)
    torch.testing.assert_close(wrapped(x), eager(x))
    assert len(wrapped._ortrain_graphs) == 1
    # In-place change of the same tensor: seen too.
    for m in (model, eager):
        m.scale.mul_(2)
    torch.testing.assert_close(wrapped(x), eager(x))
    # Another shape (broadcast): a new capture, and the log says why.
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for m in (model, eager):
            m.scale = torch.tensor(2.0)
        torch.testing.assert_close(wrapped(x), eager(x))
    assert any("tensor attribute 'scale'" in r.getMessage() for r in caplog.records)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    assert_same_state(wrapped, eager)
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)


class _CachedMask(nn.Module):
    """A causal mask built on first use and cached by ``functools.cached_property``: the value
    lands in the instance's ``__dict__``, under a name its class has too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        return torch.tril(torch.ones(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.mask


def test_a_cached_property_tensor_is_captured_as_an_input() -> None:
    """Until wave 31 the capture refused the name (``register_buffer``: "attribute 'mask' already
    exists") and the model fell back to PyTorch for good."""
    torch.manual_seed(0)
    model = _CachedMask()
    batches = [(torch.randn(3, 6), torch.randn(3, 6)) for _ in range(4)]
    loss_fn = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, loss_fn)
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=1e-7)
    assert_same_state(wrapped, eager)
    assert wrapped._ortrain_graphs, "the model fell back to PyTorch"
    assert isinstance(vars(_CachedMask)["mask"], functools.cached_property)  # the class as it was
    assert "mask" not in model._buffers and type(model.__dict__["mask"]) is torch.Tensor
    # The mask is an input of the graph, read at every step: changed in place, the next step sees it.
    x = torch.randn(3, 6)
    for m in (model, eager):
        m.mask.mul_(0.5)
    torch.testing.assert_close(wrapped(x), eager(x))
