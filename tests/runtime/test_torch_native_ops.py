"""The operators kept in PyTorch because of what they are (ortrain/runtime/torch_native_ops.py)."""

from __future__ import annotations

import torch

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
