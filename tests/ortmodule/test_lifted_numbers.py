"""A number argument that changes between calls is a 0-d tensor in the graph: formatted as text it
captures per value (it was the tensor's own text, silently), and returned, it is a number again."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ortrain import ORTModule

SPECIAL = {"block2"}


class _NamedBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, block: int, steps: int) -> dict[str, object]:
        y = self.fc(x) * block
        if f"block{block}" in SPECIAL:  # wave 45's review: the branch of no value at all
            y = y * 2
        made = torch.as_tensor(steps)  # eager: a tensor, whatever the graph holds
        return {"loss": y.pow(2).mean(), "block": block, "steps": steps + x.shape[0], "made": made}


def test_a_number_argument_formatted_or_returned_is_eager() -> None:
    torch.manual_seed(0)
    eager = _NamedBlocks()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step, block in enumerate((1, 2, 3, 2)):
        x = torch.randn(3, 4)
        expected, got = eager(x, block, 10 * step), wrapped(x, block, 10 * step)
        torch.testing.assert_close(got["loss"], expected["loss"])
        for key in ("block", "steps"):
            assert type(got[key]) is int and got[key] == expected[key], (step, key, got[key])
        assert isinstance(got["made"], torch.Tensor) and got["made"].item() == expected["made"].item()
        expected["loss"].backward()
        got["loss"].backward()
        torch.testing.assert_close(wrapped.module.fc.weight.grad, eager.fc.weight.grad)


STAGE_SCALE = {1: 2.0, 2: 4.0}


class _Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        weight = 0.0 if stage in {3} else 1.0
        # ``stage`` read as a number too: a graph input from its second value on
        return (self.fc(x) * STAGE_SCALE.get(stage, 1.0) * weight * (1 + 0.01 * stage)).pow(2).mean()


def test_a_number_argument_looked_up_in_a_dict_is_eager() -> None:
    """Traced, the number is a tensor hashed by identity: the lookup missed and the default was
    baked in for every value (wave 45's review: loss 0.58 where eager's was 1.60, silently)."""
    torch.manual_seed(0)
    eager = _Staged()
    wrapped = ORTModule(copy.deepcopy(eager))
    for stage in (0, 1, 2, 3, 1):
        x = torch.randn(3, 4)
        torch.testing.assert_close(wrapped(x, stage), eager(x, stage))


class _Powers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        # Python's int ** negative int is a float; traced as an int tensor it was 0 (wave 47).
        return self.fc(x) * (n**-1 + 2**-n + n**2)


def test_an_int_argument_raised_to_a_negative_power_is_pythons_float() -> None:
    torch.manual_seed(0)
    eager = _Powers()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 3)
    for n in (3, 5, 4):
        expected, got = eager(x, n), wrapped(x, n)
        torch.testing.assert_close(got, expected)
        expected.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(wrapped.fc.weight.grad, eager.fc.weight.grad)


class _ScheduledScale(torch.autograd.Function):
    """Branches on the type of its numbers, as code written for Python numbers may."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float, repeats: int) -> torch.Tensor:
        if not isinstance(alpha, float):  # the branch eager never takes
            alpha = alpha * 0.5
        if not isinstance(repeats, int):
            repeats = repeats + 1
        ctx.factor = alpha * repeats
        return x * ctx.factor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.factor, None, None


class _Scheduled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, alpha: float, repeats: int) -> torch.Tensor:
        return _ScheduledScale.apply(self.fc(x), alpha, repeats).pow(2).mean()


def test_number_arguments_reach_an_opaque_function_as_numbers() -> None:
    # Wave 48's review: from a number's second value on, the Function got the graph's 0-d tensor.
    torch.manual_seed(0)
    eager = _Scheduled()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step, (alpha, repeats) in enumerate([(0.5, 2), (0.25, 3), (0.125, 4)]):
        x = torch.randn(3, 4)
        expected, got = eager(x, alpha, repeats), wrapped(x, alpha, repeats)
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected, msg=f"step {step}")
        torch.testing.assert_close(wrapped.fc.weight.grad, eager.fc.weight.grad, msg=f"step {step}")


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, open_: bool) -> torch.Tensor:
        ctx.factor = 2.0 if open_ is True else 0.5  # a 0-d tensor is not True
        return x * ctx.factor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, bool]:
        return _Gate.apply(self.fc(x), alpha > 0.3).pow(2).mean(), alpha > 0.6


def test_a_comparison_of_number_arguments_is_a_bool_as_in_python() -> None:
    # Wave 49's regression review: ``alpha > 0.3`` reached the Function as a 0-d tensor.
    torch.manual_seed(0)
    eager = _Gated()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step, alpha in enumerate((0.5, 0.75, 0.2, 0.9)):
        x = torch.randn(3, 4)
        (expected, expected_flag), (got, got_flag) = eager(x, alpha), wrapped(x, alpha)
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected, msg=f"step {step}")
        torch.testing.assert_close(wrapped.fc.weight.grad, eager.fc.weight.grad, msg=f"step {step}")
        assert type(got_flag) is bool and got_flag == expected_flag, (step, got_flag)
