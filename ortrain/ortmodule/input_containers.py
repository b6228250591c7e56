"""A forward that changes the containers it is given: ``batch["logits"] = out`` into the batch dict,
``features.append(h)`` into a list passed to collect activations, ``del batch["labels"]``,
``batch.logits = out`` on a dataclass batch.

In eager PyTorch the caller's dict or list holds the change afterwards. A capture runs the forward
on containers rebuilt from the call's flat tensors (``ortrain.ortmodule.schema``), so the change
happened to those, once, while tracing: the caller's batch never got its ``logits`` (wave 29, found
by a trial; a later ``batch["logits"]`` raised KeyError, a check ``if "logits" in batch`` took the
other branch silently). TorchDynamo replays such changes on the caller's containers at every step.

So the containers' contents are compared before and after the traced forward, and a change
refuses the capture with :class:`InputContainerChange`: the model then trains through TorchDynamo's
graph breaks. Writes into the tensors themselves (``x.add_(1)``) are not container changes: the
captured graph writes them back into the caller's tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ortrain.ortmodule.schema import passes_by_attributes


class InputContainerChange(RuntimeError):
    """The forward added, removed or replaced an entry of a list, dict or dataclass it was given."""


def contents(value: Any) -> Any:
    """What a change to the containers in ``value`` would change: their entries' identities, nested."""
    if isinstance(value, dict):
        return ("dict", id(value), tuple((key, contents(item)) for key, item in value.items()))
    if isinstance(value, list):
        return ("list", id(value), tuple(contents(item) for item in value))
    if isinstance(value, tuple):  # immutable: only what it holds can change
        return ("tuple", tuple(contents(item) for item in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple((f.name, contents(getattr(value, f.name, None))) for f in dataclasses.fields(value))
        return ("dataclass", id(value), fields)
    if passes_by_attributes(value):  # ``batch.logits = out`` on an object or a namespace
        return ("object", id(value), tuple((key, contents(item)) for key, item in vars(value).items()))
    return id(value)


def refuse_changed_containers(before: Any, after: Any) -> None:
    """Raise :class:`InputContainerChange` where ``after`` (:func:`contents`) differs from ``before``."""
    if before != after:
        raise InputContainerChange(
            "the forward changes a list, dict, dataclass or object it was given (an entry added, removed or "
            "replaced): "
            "a captured graph would do that once, while it was traced, to a copy, and never to the "
            "caller's"
        )
