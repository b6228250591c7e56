"""A forward that changes an input's shape or strides in place (``x.t_()``, ``x.unsqueeze_(0)``,
``x.resize_(...)``, ``x.transpose_(0, 1)``) is refused by the whole-graph capture.

AOTAutograd records such a change as a metadata mutation, which its own runtime replays on the
caller's tensor after each call (``as_strided_`` with the traced sizes and strides). ortrain's
runtime does not: until wave 42 the caller's ``x`` came back with the new shape over contiguous
strides (values scrambled, silently), and every backward then failed on a version counter.
TorchDynamo's graphs go through AOTAutograd's runtime, so ORTModule trains such a model through
graph breaks (:mod:`ortrain.ortmodule.graph_breaks`), with one INFO line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class InputMetadataChangeError(RuntimeError):
    """The forward changes the shape or strides of the inputs named, in place."""


def refuse_metadata_changes(input_info: Sequence[Any], names: Sequence[str]) -> None:
    """Raise :class:`InputMetadataChangeError` if AOTAutograd's ``input_info`` (one per graph input,
    named by ``names``) records a metadata mutation."""
    changed = [name for name, info in zip(names, input_info, strict=False) if info.mutates_metadata]
    if changed:
        raise InputMetadataChangeError(
            f"the forward changes the shape or strides of {', '.join(changed)} in place "
            "(t_, transpose_, unsqueeze_, squeeze_, resize_, as_strided_)"
        )
