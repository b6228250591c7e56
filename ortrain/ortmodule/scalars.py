"""Python numbers that change between calls become graph inputs instead of baked-in constants.

A float argument from a schedule (a temperature, a loss weight) would otherwise capture the model
again at every new value. The first value is baked in, as sizes are static at first; when a
second value arrives at the same place, that argument becomes a 0-d tensor input of a new graph
(``float`` → the default float dtype, ``int`` → int64: the dtypes a Python number takes part in
type promotion as), and later values reuse that graph. Booleans and strings stay part of the
graph's key.

The model's Python may need a real number there (``range(n)``, ``math.exp(t)``, a slice bound):
then the capture with a tensor fails, the argument is refused, and every value of it captures
again as before (the graph cache bounds how many are kept, and names the argument). Where
several numbers were lifted together, the failure does not say which one the model needs: they
are then lifted one at a time, and only the one whose lifting fails is refused (wave 26: a float
schedule value next to a step index the model branches on had both refused, and every step
captured a graph).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ortrain.ortmodule.schema import LiftedNumber, Spec

if TYPE_CHECKING:
    from ortrain.capture.aot_capture import Capture

logger = logging.getLogger("ortrain.ortmodule")

_LIFTABLE = (float, int)
# Container nodes whose children are named by the keys at spec[2]; the others by position.
_KEYED = ("dict", "model_output", "dataclass", "object", "distribution")


def _is_liftable(leaf: Spec) -> bool:
    return leaf[0] == "const" and leaf[1] in _LIFTABLE  # exact types: bool is not lifted


def call_leaves(spec: Spec) -> list[tuple[str, Spec]]:
    """Every leaf of a call's spec ``(args, kwargs)`` with its place, in flattening order.

    Places read ``input 0``, ``input 'labels'``, then ``.field``, ``['key']`` or ``[i]`` below.
    """
    (_, _, (args, kwargs)) = spec
    leaves: list[tuple[str, Spec]] = []
    for position, child in enumerate(args[-1]):
        leaves += _leaves(child, f"input {position}")
    for key, child in zip(kwargs[2], kwargs[-1], strict=True):
        leaves += _leaves(child, f"input {key!r}")
    return leaves


def _leaves(spec: Spec, place: str) -> list[tuple[str, Spec]]:
    kind = spec[0]
    if kind in ("tensor", "const"):
        return [(place, spec)]
    children = spec[-1]
    labels = spec[2] if kind in _KEYED else range(len(children))
    leaves: list[tuple[str, Spec]] = []
    for label, child in zip(labels, children, strict=True):
        by_attribute = kind in ("dataclass", "object", "distribution")
        below = f"{place}.{label}" if by_attribute else f"{place}[{label!r}]"
        leaves += _leaves(child, below)
    return leaves


def _rewrite(
    spec: Spec,
    tensors: Iterator[torch.Tensor],
    lift: set[int],
    out: list[torch.Tensor],
    count: list[int],
    lifted_at: list[int],
) -> Spec:
    """Copy ``spec``, turning the liftable numbers whose index is in ``lift`` into tensor inputs
    (their positions among ``out`` go to ``lifted_at``)."""
    kind = spec[0]
    if kind == "tensor":
        out.append(next(tensors))
        return spec
    if kind == "const":
        if not _is_liftable(spec):
            return spec
        index = count[0]
        count[0] += 1
        if index not in lift:
            return spec
        dtype = torch.get_default_dtype() if spec[1] is float else torch.int64
        lifted_at.append(len(out))
        out.append(torch.tensor(spec[2], dtype=dtype))
        return ("tensor", LiftedNumber)
    children = tuple(_rewrite(c, tensors, lift, out, count, lifted_at) for c in spec[-1])
    return (*spec[:-1], children)


def without_number_values(spec: Spec) -> Spec:
    """The spec with every liftable number's value left out: what its graphs have in common."""
    if spec[0] == "const":
        return ("const", spec[1], None) if _is_liftable(spec) else spec
    if spec[0] == "tensor":
        return spec
    return (*spec[:-1], tuple(without_number_values(c) for c in spec[-1]))


@dataclass
class LiftedCall:
    """A call's inputs after lifting: the spec and tensors to capture and run with."""

    spec: Spec
    inputs: list[torch.Tensor]
    structure: Spec | None = None  # the masked spec, when the call has liftable numbers
    lifted: frozenset[int] = frozenset()  # which of its numbers (in flattening order) are inputs
    places: tuple[str, ...] = ()  # where each number is, for messages
    lifted_inputs: tuple[int, ...] = ()  # the positions of the lifted numbers among ``inputs``


@dataclass
class ScalarLifter:
    """Remembers, per call structure, which numbers changed and which could not be inputs."""

    first_values: dict[Spec, tuple[Any, ...]] = field(default_factory=dict)
    lifted: dict[Spec, frozenset[int]] = field(default_factory=dict)
    refused: dict[Spec, frozenset[int]] = field(default_factory=dict)
    # Structures whose numbers are lifted one at a time, and the one each lifted last.
    one_at_a_time: dict[Spec, int | None] = field(default_factory=dict)

    def lift(self, spec: Spec, inputs: list[torch.Tensor]) -> LiftedCall:
        numbers = [(place, leaf[2]) for place, leaf in call_leaves(spec) if _is_liftable(leaf)]
        if not numbers:
            return LiftedCall(spec, inputs)
        structure = without_number_values(spec)
        values = tuple(v for _, v in numbers)
        first = self.first_values.setdefault(structure, values)
        lifted = self.lifted.get(structure, frozenset())
        refused = self.refused.get(structure, frozenset())
        changed = {
            i
            for i, (a, b) in enumerate(zip(values, first, strict=True))
            if a != b and all(_fits_int64(v) for v in (a, b))
        }
        new = changed - lifted - refused
        if new and structure in self.one_at_a_time:
            new = {min(new)}
            self.one_at_a_time[structure] = min(new)
        if new:
            lifted = lifted | new
            self.lifted[structure] = lifted
            for i in sorted(new):
                logger.info(
                    "%s changed from %r to %r: it becomes an input of the graph instead of a constant",
                    numbers[i][0],
                    first[i],
                    values[i],
                )
        places = tuple(place for place, _ in numbers)
        if not lifted:
            return LiftedCall(spec, inputs, structure, places=places)
        out: list[torch.Tensor] = []
        lifted_at: list[int] = []
        new_spec = _rewrite(spec, iter(inputs), set(lifted), out, [0], lifted_at)
        return LiftedCall(new_spec, out, structure, lifted, places, tuple(lifted_at))

    def refuse(self, call: LiftedCall, why: str = "needs", unread: frozenset[int] | None = None) -> None:
        """The capture with ``call``'s numbers lifted failed (``why="needs"``), or its graph leaves
        the numbers ``unread`` unread: bake those values in from now on.

        A failure with several numbers lifted does not say which one the model needs as a Python
        number: the first time, none is refused and the numbers are lifted one at a time from then
        on; in that mode a failure refuses the number lifted last."""
        structure = call.structure
        assert structure is not None
        if unread is not None:
            refused = unread
        elif len(call.lifted) == 1:
            refused = call.lifted
        elif structure not in self.one_at_a_time:
            self.one_at_a_time[structure] = None
            self.lifted[structure] = frozenset()
            logger.info(
                "a capture with %s as tensors failed: they become inputs one at a time, to find "
                "which the model needs as a Python number",
                ", ".join(call.places[i] for i in sorted(call.lifted)),
            )
            return
        else:
            last = self.one_at_a_time[structure]
            refused = frozenset({last}) if last in call.lifted else call.lifted
        self.refused[structure] = self.refused.get(structure, frozenset()) | refused
        self.lifted[structure] = call.lifted - refused
        places = ", ".join(call.places[i] for i in sorted(refused))
        if why == "needs":
            logger.info("the model needs %s as Python numbers: each new value captures again", places)
        else:
            logger.info(
                "the captured graph does not read %s as a tensor: the model checks its type (an int "
                "or a tensor?) or ignores it; each new value captures again",
                places,
            )


def _fits_int64(value: Any) -> bool:
    """A Python int far from int64's range may overflow as a tensor where Python's does not (a
    hash of it, say): such numbers stay constants."""
    return not isinstance(value, int) or -(2**31) < value < 2**31


def unread_lifted_inputs(call: LiftedCall, capture: Capture, aliased: bool) -> frozenset[int]:
    """The lifted numbers the forward graph captured for ``call`` leaves unread: the model took
    another path for a tensor than for a number (``isinstance(n, int)``), or does not use it at all.
    Either way the graph is not the one the number would have given. Where the graph's inputs
    cannot be told apart (aliased inputs merged into one), all are taken as unread: baked in, each
    value gets its own graph, which is always right."""
    if not call.lifted_inputs:
        return frozenset()
    placeholders = capture.input_placeholders(call.inputs, aliased)
    numbers = sorted(call.lifted)  # lifted_inputs holds their positions, in the same order
    return frozenset(
        number
        for number, position in zip(numbers, call.lifted_inputs, strict=True)
        if placeholders is None or not placeholders[position].users
    )
