"""What counts as a patch of PyTorch made before ortrain was imported (no snapshot to compare with)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from ortrain.cache import torch_namespaces


@pytest.mark.parametrize(
    ("space", "name", "value"),
    [
        ("torch", "relu", torch.sigmoid),
        ("torch.nn.functional", "gelu", F.silu),
        ("torch.nn.functional", "relu", functools.partial(F.leaky_relu, negative_slope=0.3)),
        ("torch.nn.functional", "relu", lambda x, inplace=False: F.leaky_relu(x, 0.3)),
    ],
    ids=["builtin", "function", "partial", "lambda"],
)
def test_a_patch_made_before_the_snapshot_looks_patched(space: str, name: str, value: object) -> None:
    assert torch_namespaces._looks_patched(space, name, value)


@pytest.mark.parametrize(
    ("space", "name"),
    [
        ("torch", "relu"),
        ("torch.special", "erf"),
        ("torch.nn.functional", "logsigmoid"),
        ("torch.Tensor", "__abs__"),
    ],
)
def test_pytorchs_own_entries_do_not(space: str, name: str) -> None:
    value = torch_namespaces._AT_IMPORT[space][name]
    assert not torch_namespaces._looks_patched(space, name, value)


def test_an_unpatched_process_finds_only_pytorchs_own_aliases() -> None:
    """They are described the same way in every process: unpatched runs still hit."""
    found = torch_namespaces.replaced_entries()
    assert not any(name.endswith((".relu", ".gelu", ".__mul__")) for name in found)
    assert len(found) < 20
