"""``h[mask] = row``: the override's values and gradients are eager's ``index_put_``'s, and every
assignment it cannot write without the mask's count is left to PyTorch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ortrain.capture.boolean_mask_assignment import assign_through_mask

MASK = torch.tensor([[True, False, True], [False, False, True]])

# (index into a (2, 3, 4) target, the value's shape)
ONE_ROW_CASES = {
    "mask (2,3), value (4,)": (MASK, (4,)),
    "mask (2,3), value (1,4)": (MASK, (1, 4)),
    "mask (2,3), value (1,1,4) (leading ones)": (MASK, (1, 1, 4)),
    "mask (2,3), value (1,)": (MASK, (1,)),
    "mask (2,3), value 0-d (a learned scalar)": (MASK, ()),
    "mask (2,), value (3,4)": (MASK[:, 0], (3, 4)),
    "mask (2,3,4), value (1,)": (torch.arange(24).reshape(2, 3, 4) % 5 == 0, (1,)),
    "[:, mask (3,)], value (2,1,4): per leading row": ((slice(None), MASK[0]), (2, 1, 4)),
    "[:, :, mask (4,)], value (2,3,1)": (
        (slice(None), slice(None), torch.tensor([1, 0, 0, 1]).bool()),
        (2, 3, 1),
    ),
}


def _assigned(index: Any, value: torch.Tensor, assign: Any) -> tuple[torch.Tensor, ...]:
    base = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    row = value.clone().requires_grad_()
    target = base * 1.0
    assign(target, index, row)
    weights = torch.arange(24.0).reshape(2, 3, 4)
    base_grad, row_grad = torch.autograd.grad((target * weights).sum(), (base, row))
    return target.detach(), base_grad, row_grad


@pytest.mark.parametrize("case", list(ONE_ROW_CASES), ids=str)
def test_values_and_gradients_are_index_puts(case: str) -> None:
    index, shape = ONE_ROW_CASES[case]
    value = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    expected = _assigned(index, value, torch.Tensor.__setitem__)
    got = _assigned(index, value, assign_through_mask)
    torch.testing.assert_close(got, expected)


def test_it_writes_through_a_view() -> None:
    whole = torch.zeros(3, 3, 4)
    assert assign_through_mask(whole[1:], MASK, torch.ones(4)) is None
    expected = torch.zeros(3, 3, 4)
    expected[1:][MASK] = 1.0
    torch.testing.assert_close(whole, expected)


@pytest.mark.parametrize(
    ("index", "value"),
    [
        (MASK, torch.ones(3, 4)),  # one row per selected position: only the count says which
        (MASK, torch.ones(4, dtype=torch.float64)),  # eager refuses the dtype: its error stays
        (MASK, torch.tensor(2.0)),  # 0-d: eager's masked_fill_, which traces
        (MASK.long(), torch.ones(4)),  # an integer index, not a mask
        ((0, MASK[0]), torch.ones(4)),  # an integer before the mask
        ((slice(1, None), MASK[1:]), torch.ones(4)),  # a partial slice before it
        (MASK[0], torch.ones(4)),  # eager's "shape of the mask does not match" error stays
    ],
    ids=[
        "one row each",
        "other dtype",
        "0-d",
        "integer index",
        "integer first",
        "partial slice",
        "wrong mask",
    ],
)
def test_other_assignments_are_pytorchs(index: Any, value: torch.Tensor) -> None:
    target = torch.zeros(2, 3, 4)
    assert assign_through_mask(target, index, value) is NotImplemented
    assert not target.any()
