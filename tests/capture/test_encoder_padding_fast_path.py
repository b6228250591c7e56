"""``nn.TransformerEncoder`` in inference with a padding mask: the padded positions as eager's
nested-tensor path leaves them (ortrain/capture/encoder_padding_fast_path.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTModule


def _encoder(norm: bool, mask_check: bool) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    final = nn.LayerNorm(16) if norm else None
    return nn.TransformerEncoder(layer, 2, norm=final, enable_nested_tensor=True, mask_check=mask_check)


def _padding(left: bool, as_float: bool) -> torch.Tensor:
    pads = torch.zeros(3, 7, dtype=torch.bool)
    pads[1, 5:] = True
    pads[2, 3:] = True
    if left:
        pads = pads.flip(-1)
    return torch.zeros(3, 7).masked_fill(pads, float("-inf")) if as_float else pads


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("mask_check", [True, False])
@pytest.mark.parametrize("as_float", [False, True])
def test_padded_positions_match_eager_in_inference(norm: bool, mask_check: bool, as_float: bool) -> None:
    """Until wave 31 the captured graph ran the regular path, whose padded positions hold values
    where eager's hold zeros (or the final norm of zeros): 2.3 apart. One graph serves right- and
    left-padded batches (eager packs only the first); without ``mask_check``, eager's own reading
    of a left-padded mask (each row's first tokens) is reproduced too."""
    encoder = _encoder(norm, mask_check).eval()
    wrapped = ORTModule(copy.deepcopy(encoder))
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for left in (False, True):
            mask = _padding(left, as_float)
            torch.testing.assert_close(
                wrapped(x, src_key_padding_mask=mask), encoder(x, src_key_padding_mask=mask)
            )
    assert len(wrapped._ortrain_graphs) == 1


def test_training_and_gradients_keep_the_regular_path() -> None:
    encoder = _encoder(norm=True, mask_check=True)
    wrapped = ORTModule(copy.deepcopy(encoder))
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2))
    mask = _padding(left=False, as_float=False)
    for model in (encoder, wrapped):
        model.eval()  # eval, but with gradients: eager runs the regular path
    expected = encoder(x, src_key_padding_mask=mask)
    got = wrapped(x, src_key_padding_mask=mask)
    torch.testing.assert_close(got, expected)
    assert expected[2, 5].abs().sum() > 0  # padded positions hold values on this path
    got.sum().backward()
    expected.sum().backward()
    for a, b in zip(wrapped.parameters(), encoder.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_switching_the_fast_path_between_calls_is_seen() -> None:
    # Wave 49's review: the graph captured with the fast path on kept zeroing padded positions
    # after torch.backends.mha.set_fastpath_enabled(False), where eager computes them.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    eager = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    wrapped = ORTModule(copy.deepcopy(eager)).eval()
    x = torch.randn(3, 7, 16)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[0, -2:] = True
    try:
        with torch.no_grad():
            for enabled in (True, False, True):
                torch.backends.mha.set_fastpath_enabled(enabled)
                expected = eager(x, src_key_padding_mask=padding)
                got = wrapped(x, src_key_padding_mask=padding)
                torch.testing.assert_close(got, expected, msg=f"fast path {enabled}")
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
