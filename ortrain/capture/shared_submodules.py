"""A submodule registered under two names (``self.a = self.b = block``, ``nn.Sequential(*[block] * 3)``)
keeps its parameters through a capture.

AOTAutograd swaps the model's parameters for graph inputs by every name they have
(``named_parameters(remove_duplicate=False)``) and swaps them back in the same order
(``torch.nn.utils.stateless._reparametrize_module``). With one module under two names, the second
name's "original" is the value the first name's swap put in: swapped back first-to-last, the
module ends up holding the traced value, not its parameter. ortrain saw the model changed by the
capture, ran that step in PyTorch, then took the model for one whose forward changes it at every
call and trained it through TorchDynamo's graph breaks for good (wave 42: weight-shared blocks).
Swapped back last-to-first (the function's own ``stack_weights`` option), every name gets its
parameter back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.nn.utils import stateless


@contextlib.contextmanager
def shared_submodules_restored() -> Iterator[None]:
    """While capturing: AOTAutograd's swaps restore in reverse order (see the module)."""
    original = stateless._reparametrize_module

    def in_reverse(
        module: Any, tensors: Any, tie_weights: bool = False, strict: bool = False, **_: Any
    ) -> Any:
        return original(module, tensors, tie_weights=tie_weights, strict=strict, stack_weights=True)

    stateless._reparametrize_module = in_reverse
    try:
        yield
    finally:
        stateless._reparametrize_module = original
