"""Making a view again on another base with the view functions PyTorch recorded for it.

A view that changes the dtype (``z.real``, ``view_as_real(z)``, ``view_as_complex(x)``) or carries a
lazy conjugate or negative bit (``w.conj()``, ``w.mH``, ``z.conj().imag``) is not its layout alone:
``as_strided`` with its size, strides and offset on the base gives the base's dtype and no bits (an
output ``w.conj()`` came back as ``w``, the loss of the wrong sign, silently: wave 51's review).
Autograd records, for each view of a base, the functions that made it (``Tensor._view_func``, as
AOTAutograd replays them for outputs that alias inputs); replayed on a tensor laid out as the base,
they give the same view of that tensor, with its history.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ViewReplay = Callable[[torch.Tensor], torch.Tensor]


def view_bits(t: torch.Tensor) -> tuple[torch.dtype, bool, bool]:
    """What ``as_strided`` on a base does not carry over: the dtype and the lazy conj/neg bits."""
    return t.dtype, t.is_conj(), t.is_neg()


def view_replay(view: torch.Tensor, base: torch.Tensor) -> ViewReplay | None:
    """A function that makes ``view`` again from a tensor laid out as ``base``; None where ``view``
    is not a view whose base is ``base`` (a view of a view has the first base as its own)."""
    if view._base is not base:
        return None

    def replay(new_base: torch.Tensor) -> torch.Tensor:
        made = view._view_func(new_base)
        if made is None or made.shape != view.shape or view_bits(made) != view_bits(view):
            raise RuntimeError(f"ortrain could not make an output view again on its base ({view_bits(view)})")
        return made

    return replay
