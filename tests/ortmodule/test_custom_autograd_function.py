"""Custom ``torch.autograd.Function``s inside ORTModule: opaque PythonOps (the default) and inline.

Each pattern trains a tiny model under ORTModule and in eager PyTorch from the same start and
checks losses, gradients and parameters, and that each Function call really ran as one python op
in the forward graph (and one in the backward graph).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import _functions_a
import _functions_b
import onnx
import pytest
import torch
from _parity import assert_same_state, ort_graph_count
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from ortrain.ortmodule import (
    DebugOptions,
    ORTModule,
    ORTModuleTorchModelException,
    _custom_autograd_function,
    enable_custom_autograd_support,
)
from ortrain.ortmodule._custom_autograd_function import (
    enable_custom_autograd_support as enable_from_upstream_path,
)
from ortrain.runtime.executors.python_op import PythonOpExecutor
from ortrain.runtime.graph_executor import PlanRunner

BACKWARD_CALLS: dict[str, int] = {}


def _count(name: str, grad: torch.Tensor) -> None:
    """Count real backward runs; ortrain also runs each backward once on fake tensors at capture."""
    if not is_fake(grad):
        BACKWARD_CALLS[name] = BACKWARD_CALLS.get(name, 0) + 1


@pytest.fixture(autouse=True)
def _reset_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_custom_autograd_function, "_override", None)


# ---- the Functions ---------------------------------------------------------------------------------
class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        _count("Square", grad)
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class ScaleShift(torch.autograd.Function):
    """Non-tensor arguments in every position: ints, floats, bools, tuples, None."""

    @staticmethod
    def forward(ctx, power, x, missing, flip, shape, scale):
        assert missing is None and isinstance(shape, tuple)
        ctx.power, ctx.flip, ctx.scale = power, flip, scale
        ctx.save_for_backward(x)
        y = x.reshape(shape) ** power * scale
        return -y if flip else y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        g = grad.reshape(x.shape) * ctx.power * x ** (ctx.power - 1) * ctx.scale
        return None, (-g if ctx.flip else g), None, None, None, None


class SplitTwo(torch.autograd.Function):
    """Two outputs; the Function's backward gets zeros for the one the loss ignores."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, g_sin, g_cos):
        assert g_sin is not None and g_cos is not None  # materialized
        (x,) = ctx.saved_tensors
        return g_sin * torch.cos(x) - g_cos * torch.sin(x)


class NoMaterialize(torch.autograd.Function):
    """set_materialize_grads(False): an unused output's gradient arrives as None."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x * 3, x * 5

    @staticmethod
    def backward(ctx, g1, g2):
        _count("NoMaterialize", g1)
        assert g2 is None, "the second output is not used: eager passes None"
        return g1 * 3


class MaxWithIndex(torch.autograd.Function):
    """An integer output marked non-differentiable next to a float output."""

    @staticmethod
    def forward(ctx, x):
        values, index = x.max(dim=-1)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        return values, index

    @staticmethod
    def backward(ctx, grad, grad_index):
        (index,) = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=grad.dtype)
        return out.scatter(-1, index.unsqueeze(-1), grad.unsqueeze(-1))


class NormAndFlag(torch.autograd.Function):
    """A float output marked non-differentiable: it must not require grad, as in eager."""

    @staticmethod
    def forward(ctx, x):
        norm = x.norm(dim=-1, keepdim=True)
        ctx.save_for_backward(x, norm)
        stat = norm.detach() * 0 + 1
        ctx.mark_non_differentiable(stat)
        return x / norm, stat

    @staticmethod
    def backward(ctx, grad, grad_stat):
        x, norm = ctx.saved_tensors
        y = x / norm
        return (grad - y * (grad * y).sum(-1, keepdim=True)) / norm


class MaskedScale(torch.autograd.Function):
    """A mask input that needs no gradient: backward returns None for it; checks needs_input_grad."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        assert ctx.needs_input_grad == (True, False), ctx.needs_input_grad
        (mask,) = ctx.saved_tensors
        return grad * mask, None


class DropGrad(torch.autograd.Function):
    """Returns None for an input that requires grad: no gradient flows through that path."""

    @staticmethod
    def forward(ctx, x, y):
        return x + y.detach() * 0.5

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class NeedsInputGrad(torch.autograd.Function):
    """Computes only the gradients asked for, and records what it was asked."""

    seen: ClassVar[list[tuple[bool, ...]]] = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        if not is_fake(grad):
            NeedsInputGrad.seen.append(tuple(ctx.needs_input_grad))
        a, b = ctx.saved_tensors
        ga = grad * b if ctx.needs_input_grad[0] else None
        gb = grad * a if ctx.needs_input_grad[1] else None
        return ga, gb


class OnceTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)  # saves its output
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class AddOneInPlace(torch.autograd.Function):
    """mark_dirty: updates its input in place and returns it."""

    @staticmethod
    def forward(ctx, x):
        x.add_(1.0).mul_(2.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class FakeQuant(torch.autograd.Function):
    """A quantizer with a learned scale (LSQ-style): gradients for the input and for the scale."""

    @staticmethod
    def forward(ctx, x, scale, bits):
        qmax = 2 ** (bits - 1) - 1
        ratio = x / scale
        q = torch.clamp(torch.round(ratio), -qmax - 1, qmax)
        ctx.save_for_backward(ratio, q)
        ctx.qmax = qmax
        return q * scale

    @staticmethod
    def backward(ctx, grad):
        ratio, q = ctx.saved_tensors
        inside = (ratio >= -ctx.qmax - 1) & (ratio <= ctx.qmax)
        grad_x = grad * inside
        grad_scale = (grad * torch.where(inside, q - ratio, q)).sum().reshape(1)
        return grad_x, grad_scale, None


class Identity(torch.autograd.Function):
    """Returns its input object itself."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5  # deliberately not the identity's gradient: proves this code ran


class FlattenView(torch.autograd.Function):
    """Returns a view of its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.view(x.shape[0], -1)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape)


class Outer(torch.autograd.Function):
    """Calls another Function inside its own forward (autograd ignores the inner call, as in eager)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return Square.apply(x) + x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (2 * x + 1)


class NewStyleMul(torch.autograd.Function):
    """forward without ctx, plus setup_context."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class LinearFunction(torch.autograd.Function):
    """Megatron-style: parameters passed straight in."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        _count("LinearFunction", grad)
        x, weight = ctx.saved_tensors
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        return grad @ weight, flat_g.t() @ flat_x, flat_g.sum(0)


class GatherRows(torch.autograd.Function):
    """An integer index input next to a float table."""

    @staticmethod
    def forward(ctx, table, index):
        ctx.save_for_backward(index)
        ctx.rows = table.shape[0]
        return table[index]

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = torch.zeros(ctx.rows, grad.shape[-1], dtype=grad.dtype)
        return out.index_add(0, index.reshape(-1), grad.reshape(-1, grad.shape[-1])), None


class WithNoneOutput(torch.autograd.Function):
    """A None among the outputs; written in the setup_context style."""

    @staticmethod
    def forward(x):
        return x.exp(), None

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[0])

    @staticmethod
    def backward(ctx, grad, _none):
        (y,) = ctx.saved_tensors
        return grad * y


class Lgamma(torch.autograd.Function):
    """No ONNX translation exists for lgamma/digamma: opaque mode still trains it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.lgamma(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.digamma(x)


class Pair(torch.autograd.Function):
    """The same tensor passed twice."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b + a

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * (b + 1), grad * a


def _make_local_scale(factor: float) -> type[torch.autograd.Function]:
    class Scale(torch.autograd.Function):  # same __qualname__ for every factor
        @staticmethod
        def forward(ctx, x):
            return x * factor

        @staticmethod
        def backward(ctx, grad):
            return grad * factor

    return Scale


# ---- the models ------------------------------------------------------------------------------------
class Wrap(nn.Module):
    """``Linear -> body(h) -> Linear -> sum``: the body is where the Functions are called."""

    def __init__(self, body: Callable[[nn.Module, torch.Tensor], torch.Tensor], width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.out = nn.Linear(width, 1)
        self.body = body
        self.extra = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self, self.inp(x))).square().mean()


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OnceTanh.apply(self.lin(x))


class Nested(nn.Module):
    """A module using a Function that contains a module using another Function."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(Square.apply(self.inner(x))).mean()


class Megatron(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 6) * 0.3)
        self.b1 = nn.Parameter(torch.zeros(8))
        self.w2 = nn.Parameter(torch.randn(1, 8) * 0.3)
        self.b2 = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _functions_a.Gelu.apply(LinearFunction.apply(x, self.w1, self.b1))
        return LinearFunction.apply(h, self.w2, self.b2).square().mean()


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 6))
        self.head = nn.Linear(6, 1)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.head(GatherRows.apply(self.table, index)).square().mean()


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.tensor([0.1]))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(FakeQuant.apply(self.lin(x), self.scale, 4)).square().mean()


LOCAL_A, LOCAL_B = _make_local_scale(2.0), _make_local_scale(-3.0)


@dataclass
class Pattern:
    build: Callable[[], nn.Module]
    ops: int  # python ops in the forward graph (and in the backward graph)
    batch: Callable[[int], Any] = lambda i: torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
    grad_ops: int | None = None  # in the backward graph, where a call's outputs get no gradient


def _wrap(body: Callable[[nn.Module, torch.Tensor], torch.Tensor], width: int = 6) -> Callable[[], nn.Module]:
    return lambda: Wrap(body, width)


PATTERNS: dict[str, Pattern] = {
    "save_for_backward": Pattern(_wrap(lambda m, h: Square.apply(h)), 1),
    "non_tensor_arguments_everywhere": Pattern(
        _wrap(lambda m, h: ScaleShift.apply(2, h, None, True, (4, 2, 3), 0.5).reshape(4, 6)), 1
    ),
    "two_outputs_one_unused": Pattern(_wrap(lambda m, h: SplitTwo.apply(h)[0]), 1),
    "two_outputs_both_used": Pattern(_wrap(lambda m, h: SplitTwo.apply(h)[0] * SplitTwo.apply(h)[1]), 2),
    "set_materialize_grads_false": Pattern(_wrap(lambda m, h: NoMaterialize.apply(h)[0]), 1),
    "integer_output_non_differentiable": Pattern(
        _wrap(
            lambda m, h: h * MaxWithIndex.apply(h)[0].unsqueeze(-1) + MaxWithIndex.apply(h)[1].unsqueeze(-1)
        ),
        2,
        grad_ops=1,  # only the index of the second call is used: no gradient flows into it
    ),
    "float_output_marked_non_differentiable": Pattern(
        _wrap(lambda m, h: NormAndFlag.apply(h)[0] * NormAndFlag.apply(h)[1]), 2, grad_ops=1
    ),
    "none_gradient_for_mask": Pattern(_wrap(lambda m, h: MaskedScale.apply(h, (h > 0).float())), 1),
    "none_gradient_for_input_needing_grad": Pattern(
        _wrap(lambda m, h: DropGrad.apply(h, m.extra * h) + m.extra), 1
    ),
    "needs_input_grad": Pattern(_wrap(lambda m, h: NeedsInputGrad.apply(h, torch.ones(6) * 2)), 1),
    "once_differentiable_saves_output": Pattern(_wrap(lambda m, h: OnceTanh.apply(h)), 1),
    "mark_dirty_in_place": Pattern(_wrap(lambda m, h: AddOneInPlace.apply(h * 1.0) * h), 1),
    "mark_dirty_then_reuse_input": Pattern(_wrap(lambda m, h: _dirty_reuse(h)), 1),
    "straight_through_estimator": Pattern(_wrap(lambda m, h: RoundSTE.apply(h) * m.extra), 1),
    "identity_returns_input": Pattern(_wrap(lambda m, h: Identity.apply(h) + h), 1),
    "returns_view_of_input": Pattern(_wrap(lambda m, h: FlattenView.apply(h.reshape(4, 2, 3))), 1),
    "chained_functions": Pattern(_wrap(lambda m, h: OnceTanh.apply(Square.apply(h))), 2),
    "same_function_twice": Pattern(_wrap(lambda m, h: Square.apply(Square.apply(h) * 0.1)), 2),
    "function_inside_function_forward": Pattern(_wrap(lambda m, h: Outer.apply(h)), 1),
    "setup_context_style": Pattern(_wrap(lambda m, h: NewStyleMul.apply(h, m.extra)), 1),
    "none_output": Pattern(_wrap(lambda m, h: WithNoneOutput.apply(h * 0.1)[0]), 1),
    "forward_has_no_onnx_translation": Pattern(_wrap(lambda m, h: Lgamma.apply(h.abs() + 1)), 1),
    "same_tensor_twice": Pattern(_wrap(lambda m, h: Pair.apply(h, h)), 1),
    "non_contiguous_input": Pattern(_wrap(lambda m, h: Square.apply(h.t()).t()), 1),
    "local_classes_with_one_qualified_name": Pattern(
        _wrap(lambda m, h: LOCAL_A.apply(h) + LOCAL_B.apply(h)), 2
    ),
    "same_class_name_in_two_modules": Pattern(
        _wrap(lambda m, h: _functions_a.Gelu.apply(h) * _functions_b.Gelu.apply(h)), 2
    ),
    "nested_modules": Pattern(Nested, 2),
    "parameters_as_direct_inputs": Pattern(Megatron, 3),
    "integer_index_input": Pattern(
        Embedding, 1, batch=lambda i: torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(i))
    ),
    "quantizer_with_learned_scale": Pattern(Quantized, 1),
}


# Patterns also run in eval() under no_grad (an inference capture each: kept to a few for time).
EVAL_TOO = {"save_for_backward", "mark_dirty_then_reuse_input", "parameters_as_direct_inputs", "none_output"}


def _dirty_reuse(h: torch.Tensor) -> torch.Tensor:
    t = h * 1.0
    out = AddOneInPlace.apply(t)
    assert out is t
    return t * 0.5 + out  # reads the updated input


def python_op_counts(model: ORTModule) -> list[tuple[int, int]]:
    """(forward python ops, backward python ops) per captured graph pair."""
    counts = []
    for entries in model._ortrain_graphs.values():
        for entry in entries:
            pair = []
            for slot in (entry.capture.forward, entry.capture.backward):
                runner = slot.runner if slot is not None else None
                steps = runner.plan.steps if isinstance(runner, PlanRunner) else []
                pair.append(sum(isinstance(s.executor, PythonOpExecutor) for s in steps))
            counts.append((pair[0], pair[1]))
    return counts


def train_and_compare(model: nn.Module, batches: list[Any], *, steps_eval: bool = True) -> ORTModule:
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    opt_ort = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    for batch in batches:
        losses = []
        for module, opt in ((wrapped, opt_ort), (eager, opt_eager)):
            opt.zero_grad()
            loss = module(batch)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        for (name, p_ort), p_eager in zip(wrapped.named_parameters(), eager.parameters(), strict=True):
            if p_eager.grad is None:
                assert p_ort.grad is None or not p_ort.grad.any(), name
            else:
                torch.testing.assert_close(p_ort.grad, p_eager.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt_ort.step()
        opt_eager.step()
    assert_same_state(eager, wrapped)
    if steps_eval:
        wrapped.eval()
        eager.eval()
        with torch.no_grad():
            torch.testing.assert_close(wrapped(batches[0]), eager(batches[0]), rtol=1e-5, atol=1e-6)
    return wrapped


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_matches_eager_as_python_ops(name: str) -> None:
    pattern = PATTERNS[name]
    torch.manual_seed(0)
    in_eval = name in EVAL_TOO
    wrapped = train_and_compare(pattern.build(), [pattern.batch(i) for i in range(2)], steps_eval=in_eval)
    # Each call is one PythonOp in the forward graph and one PythonOpGrad in the backward graph.
    counts = python_op_counts(wrapped)
    assert counts[0] == (pattern.ops, pattern.ops if pattern.grad_ops is None else pattern.grad_ops)
    if in_eval:  # the inference graph runs the Functions without keeping a ctx
        assert counts[1] == (pattern.ops, 0)


def test_backward_of_the_function_itself_runs() -> None:
    BACKWARD_CALLS.clear()
    torch.manual_seed(0)
    model = Wrap(lambda m, h: Square.apply(h))
    wrapped = ORTModule(copy.deepcopy(model))
    wrapped(torch.randn(4, 6)).backward()
    assert BACKWARD_CALLS == {"Square": 1}
    NeedsInputGrad.seen.clear()
    wrapped = ORTModule(Wrap(lambda m, h: NeedsInputGrad.apply(h, torch.ones(6) * 2)))
    wrapped(torch.randn(4, 6)).backward()
    assert NeedsInputGrad.seen == [(True, False)]


def test_dynamic_shapes_with_python_ops() -> None:
    torch.manual_seed(0)
    batches = [torch.randn(n, 3, 6) for n in (2, 5, 3)]
    wrapped = train_and_compare(Megatron(), batches, steps_eval=False)
    assert python_op_counts(wrapped)[-1] == (3, 3)


def test_unsupported_function_names_itself_and_falls_back_per_policy(monkeypatch) -> None:
    class DataDependent(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x[: int(x.sum().item() > 0) + 1]

        @staticmethod
        def backward(ctx, grad):
            raise AssertionError("not reached")

    model = Wrap(lambda m, h: DataDependent.apply(h))
    with pytest.raises(ORTModuleTorchModelException, match=r"test_custom_autograd_function\..*DataDependent"):
        ORTModule(model)(torch.randn(4, 6))
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_TORCH_MODEL")
    wrapped = ORTModule(model)
    x = torch.randn(4, 6)
    torch.testing.assert_close(wrapped(x), model(x))  # PyTorch took over
    assert wrapped._ortrain_fallback.reason is not None


def test_tensors_inside_containers_are_refused_with_the_function_name() -> None:
    class TakesList(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensors):
            return tensors[0] * 2

        @staticmethod
        def backward(ctx, grad):
            return None

    with pytest.raises(ORTModuleTorchModelException, match="TakesList: argument 0 holds tensors"):
        ORTModule(Wrap(lambda m, h: TakesList.apply([h]) + h))(torch.randn(4, 6))


def test_debug_files_show_python_ops_with_fully_qualified_names(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    model = ORTModule(
        PATTERNS["same_class_name_in_two_modules"].build(), DebugOptions(save_onnx=True, onnx_prefix="m")
    )
    model(torch.randn(4, 6)).backward()
    local = ORTModule(
        PATTERNS["local_classes_with_one_qualified_name"].build(),
        DebugOptions(save_onnx=True, onnx_prefix="l"),
    )
    local(torch.randn(4, 6)).backward()

    def python_ops(path: str, op_type: str) -> list[str]:
        graph = onnx.load(tmp_path / path).graph
        nodes = [n for n in graph.node if n.op_type == op_type]
        assert all(n.domain == "com.microsoft" for n in nodes)
        return sorted(onnx.helper.get_attribute_value(n.attribute[0]).decode() for n in nodes)

    clash = ["_functions_a.Gelu", "_functions_b.Gelu"]
    local_name = "test_custom_autograd_function._make_local_scale.<locals>.Scale"
    for stage in ("exported", "optimized"):
        assert python_ops(f"m_forward_{stage}_training.onnx", "PythonOp") == clash
        assert python_ops(f"m_backward_{stage}_training.onnx", "PythonOpGrad") == clash
        assert python_ops(f"l_forward_{stage}_training.onnx", "PythonOp") == [local_name, local_name]
        assert python_ops(f"l_backward_{stage}_training.onnx", "PythonOpGrad") == [local_name, local_name]
    for path in tmp_path.iterdir():
        onnx.checker.check_model(onnx.load(path))


def test_inline_mode_traces_functions_into_the_graphs_and_can_be_switched_back() -> None:
    assert enable_custom_autograd_support is enable_from_upstream_path
    torch.manual_seed(0)
    model = Wrap(lambda m, h: _functions_a.Gelu.apply(Square.apply(h)))
    batches = [torch.randn(4, 6) for _ in range(2)]
    enable_custom_autograd_support(False)
    wrapped = train_and_compare(copy.deepcopy(model), batches)
    assert ort_graph_count(wrapped) == 2  # plain ONNX Runtime graphs: no python ops
    enable_custom_autograd_support(True)
    wrapped.train()
    wrapped(batches[0]).backward()
    # The inline training and inference captures, then a new opaque training capture.
    assert python_op_counts(wrapped) == [(0, 0), (0, 0), (2, 2)]


def test_inline_mode_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0")
    torch.manual_seed(0)
    wrapped = train_and_compare(Wrap(lambda m, h: OnceTanh.apply(h)), [torch.randn(4, 6)], steps_eval=False)
    assert python_op_counts(wrapped) == [(0, 0)]


class _TripledGradient(torch.autograd.Function):
    """A gradient scaler: its backward is not the derivative of its forward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


class _ScaledBeforeTheHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(_TripledGradient.apply(torch.tanh(self.fc1(x)))), y)


@pytest.mark.parametrize(
    "inline_by", ["ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS"]
)
def test_a_function_traced_inline_keeps_its_backward_next_to_a_forward_rewrite(
    monkeypatch: pytest.MonkeyPatch, inline_by: str
) -> None:
    """Wave 48's review: next to the linear + cross-entropy rewrite, the rewritten forward held the
    Function's forward as plain operators, and AOTAutograd differentiated those: fc1's gradient
    was a third of eager's, silently. Such a forward is captured as written now."""
    if inline_by == "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD":
        monkeypatch.setenv(inline_by, "0")
    else:
        monkeypatch.setenv(inline_by, f"{__name__}._TripledGradient")
    torch.manual_seed(0)
    eager = _ScaledBeforeTheHead().double()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    x, y = torch.randn(5, 8, dtype=torch.float64), torch.randint(0, 4, (5,))
    for module in (wrapped, eager):
        module(x, y).backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert python_op_counts(wrapped) == [(0, 0)]


class _ScaledBySize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, shape):
        ctx.k, ctx.shape = k, shape
        return (x * k).reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape) * ctx.k, None, None


class _SizedFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return _ScaledBySize.apply(h, 1.0 / x.shape[0], h.shape).pow(2).sum()


def test_a_function_given_sizes_of_a_capture_with_open_sizes_gets_the_real_ones() -> None:
    """Wave 48's review: a python op kept ``x.shape[0]`` as the capture's symbol, which reached the
    Function at every run (a loss of 2.8e14 where eager's was 41.9, ``reshape(ctx.shape)`` failed).
    Such a call is traced inline now."""
    torch.manual_seed(0)
    eager = _SizedFunction().double()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    for n in (2, 3, 5):
        x = torch.randn(n, 4, dtype=torch.float64)
        for module in (wrapped, eager):
            module.zero_grad()
            module(x).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert len(wrapped._ortrain_graphs) == 2  # fixed sizes, then open ones


class _Cube(torch.autograd.Function):
    """A new-style Function with its own vmap rule."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad

    @staticmethod
    def vmap(info, in_dims, x):
        return _Cube.apply(x), in_dims[0]


class _Scaled(NewStyleMul):
    """NewStyleMul per sample (``w`` not broadcast over a batch), with a generated vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, grad * x


class _MappedFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        cubed = torch.func.vmap(_Cube.apply)(h)
        scaled = torch.func.vmap(_Scaled.apply, in_dims=(0, None))(h, self.w)
        return (cubed + scaled).pow(2).sum()


def test_functions_mapped_with_torch_func_vmap_are_traced_inline() -> None:
    """Wave 48's review: a python op's output learning called ``requires_grad_`` under the
    transform, the capture failed blaming the Function, and the model trained in PyTorch (an error
    under FALLBACK_DISABLE, as here)."""
    torch.manual_seed(0)
    eager = _MappedFunctions().double()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    for step in range(2):
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for module in (wrapped, eager):
            module.zero_grad()
            module(x).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    # The generated rule traced inline; _Cube's own vmap rule calls it outside the transform, where
    # it is a python op again.
    assert python_op_counts(wrapped) == [(1, 1)]


class _ReachedOnlyThroughNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.extra = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DropGrad.apply(self.lin(x), self.extra.expand(x.shape[0], 6)).square().mean()


def test_a_parameter_reached_only_through_a_none_gradient_keeps_grad_none() -> None:
    # Zeros would differ from None for optimizers: weight decay and momentum skip None gradients.
    torch.manual_seed(0)
    model = _ReachedOnlyThroughNone()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x = torch.randn(4, 6)
    wrapped(x).backward()
    eager(x).backward()
    assert eager.extra.grad is None
    assert model.extra.grad is None
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)
    assert python_op_counts(wrapped)[0] == (1, 1)


class _SwitchesNone(torch.autograd.Function):
    drop: ClassVar[bool] = True

    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, grad):
        return grad, (None if _SwitchesNone.drop else grad)


class _ReturnsForTheWeightLater(torch.autograd.Function):
    drop: ClassVar[bool] = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        return grad, (None if _ReturnsForTheWeightLater.drop else (grad * x).sum(0))


@pytest.mark.parametrize(
    ("function", "second_input"),
    [(_SwitchesNone, lambda m, h: m.extra * h), (_ReturnsForTheWeightLater, lambda m, h: m.extra)],
    ids=["an intermediate", "a parameter"],
)
def test_a_gradient_the_capture_saw_as_none_raises_rather_than_being_lost(
    function: Any, second_input: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> None:
    """A parameter's too: its leaf hands a ``.grad`` the backward writes to the parameter (wave 48),
    and one it returns is still refused."""
    model = Wrap(lambda m, h: function.apply(h, second_input(m, h)))
    wrapped = ORTModule(model)
    function.drop = True
    try:
        wrapped(torch.randn(4, 6)).backward()
        function.drop = False
        with pytest.raises(RuntimeError, match=rf"{function.__name__}.*input 1"):
            wrapped(torch.randn(4, 6)).backward()
    finally:
        function.drop = True


class _MainGradLinear(torch.autograd.Function):
    """Megatron's gradient-accumulation fusion: the weight's gradient is added to its ``main_grad``
    by the backward itself, which returns None for the weight and marks it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(grad.t() @ x)
        weight.grad_added_to_main_grad = True
        return grad @ weight, None


class _GradWritingLinear(_MainGradLinear):
    """The same, writing the weight's ``.grad`` itself."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = grad.t() @ x
        else:
            weight.grad.add_(grad.t() @ x)
        return grad @ weight, None


@pytest.mark.parametrize("function", [_MainGradLinear, _GradWritingLinear])
def test_a_backward_accumulating_a_weights_gradient_itself_trains_as_eager(
    function: type[torch.autograd.Function],
) -> None:
    """Wave 48's review: the Function's leaf lacked the parameter's ``main_grad`` ("'Tensor' object
    has no attribute 'main_grad'"), and a written ``.grad`` was refused as a gradient returned at
    run time, both raised in the backward, which no fallback policy can help."""
    torch.manual_seed(0)
    eager = Wrap(lambda m, h: function.apply(h, m.extra_matrix)).double()
    eager.extra_matrix = nn.Parameter(torch.randn(6, 6, dtype=torch.float64) * 0.3)
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.extra_matrix.main_grad = torch.zeros(6, 6, dtype=torch.float64)
    wrapped = ORTModule(model)
    for _ in range(2):  # two micro-batches accumulate
        x = torch.randn(4, 6, dtype=torch.float64)
        (eager(x) / 2).backward()
        (wrapped(x) / 2).backward()
    if function is _MainGradLinear:
        torch.testing.assert_close(model.extra_matrix.main_grad, eager.extra_matrix.main_grad)
        assert model.extra_matrix.grad_added_to_main_grad
        # Eager's .grad stays None; the capture's fake run of this backward fails (fake tensors
        # carry no main_grad), so its None is not learned, and the op's zeros land there.
        grad = model.extra_matrix.grad
        assert grad is None or not grad.any()
    else:
        torch.testing.assert_close(model.extra_matrix.grad, eager.extra_matrix.grad)
    torch.testing.assert_close(model.inp.weight.grad, eager.inp.weight.grad)


class _MatMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # the forward's inputs; its product was in autocast's dtype
        return (grad @ w.t().to(grad.dtype)).to(x.dtype), (x.t().to(grad.dtype) @ grad).to(w.dtype)


class _ThroughAFunctionAndAnLSTM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.lstm = torch.nn.LSTM(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _MatMulFunction.apply(x, self.w)
        return h, self.lstm(h.float().view(2, 3, 4))[0]


def test_opaque_ops_run_in_the_autocast_region_of_their_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.autocast("cpu", torch.bfloat16)`` a Function's forward and an LSTM compute in
    bfloat16 in eager; until wave 41 their python ops ran in float32 (another dtype, values 1e-2 off,
    an RNN's weight gradient 12 % off)."""
    # ONNX Runtime has no bfloat16 Add on the CPU: the default policy runs that one in PyTorch.
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.LSTM(4, 3)(torch.randn(2, 4))
    except RuntimeError as error:  # eager PyTorch itself cannot run the model on this CPU
        pytest.skip(f"this CPU's oneDNN has no bfloat16 LSTM ({str(error).splitlines()[0][:60]})")
    torch.manual_seed(0)
    eager = _ThroughAFunctionAndAnLSTM()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = eager(x), wrapped(x)
    assert not wrapped._ortrain_fallback.active  # ran on its graphs (it failed in ONNX Runtime)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b)
    sum(o.float().sum() for o in expected).backward()
    sum(o.float().sum() for o in got).backward()
    for a, b in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


class _LogsGradientNorm(torch.autograd.Function):
    logged: ClassVar[list[Any]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _LogsGradientNorm.logged.append(grad.abs().mean().item())  # gradient monitoring
        return grad * 2


def test_a_backward_calling_item_survives_the_dynamic_capture() -> None:
    """The fake run of such a backward left an unbacked symbol pending: the dynamic capture failed
    on it and, until wave 42, the model fell back to PyTorch for good at its second batch size."""
    torch.manual_seed(0)
    batches = [torch.randn(n, 6) for n in (3, 4, 5)]
    wrapped = train_and_compare(Wrap(lambda m, h: _LogsGradientNorm.apply(h)), batches, steps_eval=False)
    assert not wrapped._ortrain_fallback.active
    assert python_op_counts(wrapped)[-1] == (1, 1)
    real = [v for v in _LogsGradientNorm.logged if isinstance(v, float)]
    assert len(real) == 2 * len(batches)  # each real backward logged once, eager's and ortrain's
