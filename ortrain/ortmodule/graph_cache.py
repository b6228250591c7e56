"""The graphs captured for one wrapped model: looked up by key, bounded, least recently used first out.

Every graph holds ONNX Runtime sessions and their memory, so a model whose inputs or state keep
changing must not collect graphs forever. Past ``capacity`` graphs (``ORTMODULE_GRAPH_CACHE_SIZE``,
8 by default) the least recently used one is dropped with its sessions, after one warning that
names what keeps changing. A model captured again at every call for the same reason (a step
counter the loop sets on a module) is warned about sooner, at the :data:`STREAK`-th such call,
with what to do: until wave 31 it captured eight times, a first step's cost each, before a word.
Each of the two warnings is given once per wrapper, independently of the other.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

logger = logging.getLogger("ortrain.ortmodule")

STREAK = 6  # captures in a row, each for the same kind of change, that are warned about

Entry = TypeVar("Entry")


class GraphCache(Generic[Entry]):
    """Groups of entries by key (one key, several size patterns), in least-recently-used order."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a graph cache holds at least one graph, not {capacity}")
        self.capacity = capacity
        self._groups: collections.OrderedDict[Hashable, list[Entry]] = collections.OrderedDict()
        self._reasons: collections.Counter[str] = collections.Counter()
        # One flag per warning: until wave 52 they shared one, and a model warned about its capture
        # streak was never told its graphs were then being evicted (nor of ORTMODULE_GRAPH_CACHE_SIZE).
        self._warned_streak = False
        self._warned_eviction = False
        self._streak: tuple[str, int] = ("", 0)  # the kind of change behind the last captures in a row
        self.last_key: Hashable | None = None
        # Why the graphs were dropped (clear()): the reason the next capture gives, not "first call".
        self.cleared_because: str | None = None

    def lookup(self, key: Hashable, fits: Callable[[Entry], bool]) -> Entry | None:
        group = self._groups.get(key)
        if group is None:
            return None
        self._groups.move_to_end(key)
        self.last_key = key
        found = next((entry for entry in group if fits(entry)), None)
        if found is not None:
            self._streak = ("", 0)
        return found

    def group(self, key: Hashable) -> list[Entry]:
        """The entries already captured under ``key`` (other sizes): empty when there are none."""
        return list(self._groups.get(key, ()))

    def groups_where(self, belongs: Callable[[Hashable], bool]) -> list[Entry]:
        """The entries of every group whose key ``belongs``."""
        return [entry for key, group in self._groups.items() if belongs(key) for entry in group]

    def add(self, key: Hashable, entry: Entry, reason: str) -> None:
        """Keep ``entry``; ``reason`` says why no cached graph fitted (counted for the warning)."""
        self._groups.setdefault(key, []).append(entry)
        self._groups.move_to_end(key)
        self.last_key = key
        self._reasons[reason] += 1
        kind = _kind(reason)
        streak = self._streak[1] + 1 if kind == self._streak[0] else 1
        self._streak = (kind, streak)
        if streak == STREAK and not self._warned_streak:
            self._warned_streak = True
            logger.warning(
                "ORTModule captured this model again at each of the last %d calls because %s each time "
                "(last: %s), each capture costing about what a first step does. %s",
                STREAK,
                kind,
                reason,
                _advice(kind),
            )
        while len(self) > self.capacity:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        oldest_key, group = next(iter(self._groups.items()))
        group.pop(0)
        if not group:
            del self._groups[oldest_key]
        if not self._warned_eviction:
            self._warned_eviction = True
            changes = "; ".join(f"{reason} ({n}×)" for reason, n in self._reasons.most_common(3))
            logger.warning(
                "ORTModule has captured more than %d graphs for this model and now drops the least "
                "recently used one each time it needs another; capturing again costs seconds a step. "
                "What keeps changing: %s. Keep it fixed, or set ORTMODULE_GRAPH_CACHE_SIZE to keep "
                "more graphs.",
                self.capacity,
                changes,
            )

    def clear(self, why: str | None = None) -> None:
        if self._groups or self.last_key is not None:  # before any graph, it is still the first call
            self.cleared_because = why
        self._streak = ("", 0)
        self._groups.clear()
        self.last_key = None

    def items(self) -> Iterator[tuple[Hashable, list[Entry]]]:
        return iter(list(self._groups.items()))

    def values(self) -> Iterator[list[Entry]]:
        return iter(list(self._groups.values()))

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def __bool__(self) -> bool:
        return bool(self._groups)


def _advice(kind: str) -> str:
    """What to do about captures in a row of one kind (until wave 45 the advice about attributes
    was given for sizes and arguments too, where it did not apply)."""
    if kind == "input sizes changed":
        return (
            "A size the model's code reads as a Python number (a pooling window of `h.size(-1)`, a "
            "branch or a loop on a size) makes each new size a new graph: pad the inputs to a few "
            "sizes (buckets), or compute with the size as tensor operations do."
        )
    if kind.startswith("input "):
        return (
            "The forward needs this argument as a Python value (a branch on it, range(), a list "
            "turned into a tensor, or formatting it as text: an f-string, even one for a log call "
            "that is not emitted): each new value is a new graph. Pass it as a tensor, keep it out "
            "of branches and text (log it in the training loop), or leave the formatting to the "
            "logger (logger.debug('step %d', step) formats only when it emits; a changing number "
            "the forward only computes with becomes an input of the graph)."
        )
    return (
        "ortrain watches every plain attribute of the model's modules and configs, and the "
        "attributes the forward reads of the other objects they hold: keep a value that changes at "
        "every step and that the forward does not read off the modules (on the training loop, or "
        "on an object a module holds), and pass one it reads to the forward as an argument (a "
        "changing number becomes an input of the graph)."
    )


def _kind(reason: str) -> str:
    """A reason without its values: "step changed from 3 to 4" and "from 4 to 5" are one kind."""
    head, found, rest = reason.partition(" changed from ")
    if not found:
        return reason
    holder = rest.rfind(" (a")  # "(an object held by 'm')", "(a config held by 'm')"
    return f"{head} changed" + (rest[holder:] if holder != -1 and rest.endswith(")") else "")
