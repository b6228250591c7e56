"""``nn.TransformerEncoder``'s padded positions as eager computes them in inference.

In ``eval()`` with gradients off and a ``src_key_padding_mask``, PyTorch's encoder packs the rows
into a nested tensor without their padding, runs its layers on that and pads the result again with
zeros (then applies its final norm, if it has one, to those zeros too). While tracing, PyTorch
turns that path off (a traced tensor "has a torch function"), so the captured graph ran the
regular path, whose padded positions hold the layers' values: a model that averages its output
over every position (a classifier's mean pooling without the mask) scored other numbers than
eager in evaluation (wave 31). The positions that are not padding are the same either way.

While capturing, an encoder that eager would run that way runs the regular path with its final
norm held back, then sets the padded positions to zero where eager's packed path would have left
zeros: with ``mask_check`` (PyTorch's default) only when every row's padding is at its end (a
left-padded batch takes the regular path in eager too), a condition the graph evaluates at every
call; without it, at the places eager assumes (:func:`_padding`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_DEVICES = frozenset({"cpu", "cuda", "xpu"})


def _packs_padding(
    encoder: nn.TransformerEncoder, src: torch.Tensor, mask: torch.Tensor | None, padding: torch.Tensor | None
) -> bool:
    """Whether eager PyTorch would run ``encoder`` on a nested tensor, as far as that depends on
    the encoder, the call and the grad mode (the alignment of the padding is checked in the graph)."""
    if padding is None or mask is not None or src.dim() != 3 or src.is_nested:
        return False
    if not torch.backends.mha.get_fastpath_enabled() or not getattr(encoder, "use_nested_tensor", False):
        return False
    first = encoder.layers[0]
    if first.training or torch.is_autocast_enabled() or src.device.type not in _DEVICES:
        return False
    weights = [
        src,
        first.self_attn.in_proj_weight,
        first.self_attn.in_proj_bias,
        first.self_attn.out_proj.weight,
        first.self_attn.out_proj.bias,
        first.norm1.weight,
        first.norm1.bias,
        first.norm2.weight,
        first.norm2.bias,
        first.linear1.weight,
        first.linear1.bias,
        first.linear2.weight,
        first.linear2.bias,
    ]
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in weights))


def _padding(encoder: nn.TransformerEncoder, padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask to run the regular path with, and the positions eager's packed path leaves zero.

    A float mask pads where it is not zero. With ``mask_check`` (PyTorch's default), eager packs
    only when every row is padded at its end, so the zeros go where the graph finds that true.
    Without it, eager takes each row's first tokens, as many as the mask leaves, whatever the mask
    says of their places: the regular path runs with that mask.
    """
    pads = padding if padding.dtype == torch.bool else padding != 0
    valid = pads.logical_not()
    if not getattr(encoder, "mask_check", True):
        kept = valid.sum(-1, keepdim=True)
        first = torch.arange(pads.shape[-1], device=pads.device) >= kept
        return first, first
    left_aligned = (valid[:, 1:] <= valid[:, :-1]).all()
    return padding, pads & left_aligned


@contextlib.contextmanager
def encoder_padding_as_eager() -> Iterator[None]:
    original = nn.TransformerEncoder.forward

    def forward(
        self: nn.TransformerEncoder,
        src: torch.Tensor,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> torch.Tensor:
        if not _packs_padding(self, src, mask, src_key_padding_mask):
            return original(self, src, mask, src_key_padding_mask, is_causal)
        assert src_key_padding_mask is not None
        padding, zeros = _padding(self, src_key_padding_mask)
        norm = self.norm
        if norm is None:
            output = original(self, src, mask, padding, is_causal)
        else:
            self._modules["norm"] = None  # applied below, after the zeros, as eager applies it
            try:
                output = original(self, src, mask, padding, is_causal)
            finally:
                self._modules["norm"] = norm
        output = output.masked_fill(zeros.unsqueeze(-1), 0.0)
        return norm(output) if norm is not None else output

    nn.TransformerEncoder.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.TransformerEncoder.forward = original  # type: ignore[method-assign]
