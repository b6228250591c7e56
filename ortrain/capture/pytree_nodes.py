"""Container types registered with torch's pytree (by transformers, say), as a stable interface."""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree


class NodeContext:
    """A pytree context made hashable, so that it can be part of a cache key."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._key = repr(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeContext) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


def flatten_registered(value: Any) -> tuple[list[Any], NodeContext] | None:
    """Children and context of ``value`` if its type is a registered pytree node, else None."""
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is None:
        return None
    children, context = node.flatten_fn(value)
    return list(children), NodeContext(context)


def unflatten_registered(cls: type, context: NodeContext, children: list[Any]) -> Any:
    return pytree.SUPPORTED_NODES[cls].unflatten_fn(children, context.value)
