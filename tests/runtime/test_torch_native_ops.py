"""The operators kept in PyTorch because of what they are (ortrain/runtime/torch_native_ops.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTModule
from ortrain.runtime.torch_native_ops import FUSED_ATTENTION, RANDOM

# Tagged random by PyTorch, but kernels of other devices, below the level graphs are traced at.
_NEVER_IN_A_CPU_GRAPH = {
    "aten._cudnn_rnn.default",
    "aten.miopen_rnn.default",
    "aten._efficient_attention_forward.default",
    "aten._flash_attention_forward.default",
    "aten._flash_attention_forward.quantized",
    "aten._fused_dropout.default",
    "aten._scaled_dot_product_attention_math_for_mps.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
}


def test_every_random_operator_of_the_installed_torch_is_known() -> None:
    """An operator PyTorch tags ``nondeterministic_seeded`` that can reach a captured graph must be
    in RANDOM (it draws from PyTorch's generator, in the forward's order), unless it is in-place
    (functionalized into its functional form), decomposed before graphs are made, or attention
    (FUSED_ATTENTION). ``normal_functional`` was missing until wave 23."""
    unknown = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.nondeterministic_seeded not in op.tags:
                continue
            if packet in RANDOM or packet in FUSED_ATTENTION or op._schema.is_mutable:
                continue
            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
                continue
            if str(op) not in _NEVER_IN_A_CPU_GRAPH:
                unknown.append(str(op))
    assert unknown == []


_DOUBLE_PRECISION_CASES = {
    "celu": lambda h: torch.nn.functional.celu(h, alpha=0.3),
    "addmm_scaled": lambda h: torch.addmm(h, h, h.T @ h / 7, beta=0.3, alpha=0.7),
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
    "sinc": torch.sinc,
    "erfc": torch.erfc,
    "erfcx": torch.special.erfcx,
    "log_ndtr": torch.special.log_ndtr,
    "lgamma": lambda h: torch.lgamma(h.abs() + 0.1),
    "mvlgamma": lambda h: torch.mvlgamma(h.abs() + 2, 2),
    # Computed alone in the forward, the statistics recomputed in the backward (wave 51's review).
    "layer_norm_checkpointed": lambda h: torch.utils.checkpoint.checkpoint(
        torch.nn.functional.layer_norm, h * 1e-3, (6,), use_reentrant=False
    ),
}


@pytest.mark.parametrize("name", list(_DOUBLE_PRECISION_CASES))
def test_float64_ops_with_single_precision_onnx_forms_match_eager_in_double(monkeypatch, name) -> None:
    """Wave 42: float32 attributes and series made these 1e-7 to 4e-6 relative off in float64 graphs
    (every other op agrees to 1e-15); they now run in PyTorch there."""
    # No fallback of the whole model; per operator only (lgamma's backward has digamma, whose
    # translation needs a Tan ONNX Runtime has no float64 kernel for).
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL")
    function = _DOUBLE_PRECISION_CASES[name]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(6, 6, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return function(self.linear(x))

    torch.manual_seed(0)
    eager = Model()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 6, dtype=torch.float64) * 2
    expected, got = eager(x), wrapped(x)
    expected.pow(3).sum().backward()
    got.pow(3).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
    for mine, theirs in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-13, atol=1e-300)
