"""Autocast's float32 policy, for the replacements the capture makes above autocast.

Under ``torch.autocast``, PyTorch runs the operators of its float32 list (``ctc_loss``, the margin
losses) on float32 copies of half-precision inputs. A replacement the capture swaps in above
autocast (``capture/function_overrides.py``) is written in operators autocast leaves alone
(``gather``, ``where``, ``sum``), so it computed in bfloat16 where eager computes in float32 (wave
48's review: CTC 5e-3 off, the margin losses 3e-3, each returning a half-precision loss). Such a
replacement casts its inputs first, as autocast would have.
"""

from __future__ import annotations

from typing import Any

import torch

_HALF = (torch.float16, torch.bfloat16)


def autocast_to_float32(tensor: Any) -> Any:
    """``tensor`` as autocast hands it to an operator of its float32 list: float32 where it is a
    half-precision tensor and autocast is on for its device; otherwise itself."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _HALF:
        return tensor
    return tensor.float() if torch.is_autocast_enabled(tensor.device.type) else tensor
