"""``torch.distributions`` objects in and out of a captured graph, by their tensors.

A policy network returns ``Normal(mu, std)`` (or a ``Categorical``, an ``Independent``, a
``TransformedDistribution`` with a ``TanhTransform``); until wave 50 ortrain refused such an
output and the model trained in PyTorch after one warning. A distribution is a plain Python object
that keeps its parameters (and the shapes it was built for) in its ``__dict__``: it goes through the
graph as its attributes do, and is rebuilt on the way out without its ``__init__`` (which would
recompute, from the graph's outputs, what the forward already computed). Its argument checks run
again on the rebuilt one, as eager's ``__init__`` runs them (a negative scale raises ``ValueError``
where validation is on); while ortrain traces they are off
(:mod:`ortrain.capture.distribution_validation`).
"""

from __future__ import annotations

from typing import Any

from torch.distributions import Distribution
from torch.distributions.transforms import Transform, _InverseTransform

# A transform's ``_inv`` holds its inverse, made on first use of ``.inv`` (``log_prob`` of a
# TransformedDistribution uses it): a cache, rebuilt on the next ``.inv``, as torch's own pickling
# treats it. torch 2.13 holds it strongly both ways (``t._inv._inv is t``), and the loop failed the
# capture with a RecursionError (wave 50's review). An ``_InverseTransform``'s ``_inv`` is not a
# cache but the transform it inverts.
_TRANSFORM_CACHES = frozenset({"_inv"})


def is_distribution_object(value: object) -> bool:
    """Whether ``value`` is a distribution or one of the transforms a distribution holds."""
    return isinstance(value, Distribution | Transform)


def attributes(value: Distribution | Transform) -> dict[str, Any]:
    """The attributes that make ``value`` what it is."""
    state = vars(value)
    if isinstance(value, Transform) and not isinstance(value, _InverseTransform):
        return {k: v for k, v in state.items() if k not in _TRANSFORM_CACHES}
    return dict(state)


def rebuilt(cls: type, state: dict[str, Any]) -> Distribution | Transform:
    """An object of ``cls`` holding ``state``, checked as eager's constructor checks it."""
    value = object.__new__(cls)
    vars(value).update(state)
    if isinstance(value, Transform):
        vars(value).setdefault("_inv", None)
    elif value._validate_args:
        # The base constructor sets the two shapes (again) and checks every parameter against its
        # constraint, exactly as the subclass's ``__init__`` ended by doing in eager code.
        Distribution.__init__(value, value.batch_shape, value.event_shape)
    return value
