"""The sympy classes PyTorch's shape environment writes symbolic sizes with, beyond sympy's own.

A size such as the diagonal length of a dynamic, non-square tensor is ``Min(5, s0)`` in PyTorch's
own ``Min`` class (not ``sympy.Min``); the exporter rebuilds such sizes from input sizes.
"""

from __future__ import annotations

from torch.utils._sympy.functions import Max as SizeMax
from torch.utils._sympy.functions import Min as SizeMin

__all__ = ["SizeMax", "SizeMin"]
