"""Fallback policies (``ORTMODULE_FALLBACK_POLICY``) and the exceptions they decide about.

When a model cannot be captured, exported or run, ortrain either keeps training it in PyTorch
(after one warning naming the cause) or raises, depending on the policy. Policy names are
upstream's, alone or joined with ``|``. The policy enum and the exceptions live in
:mod:`ortrain.errors` (below every layer) and are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from ortrain.errors import (
    FallbackPolicy,
    ORTModuleDeviceException,
    ORTModuleFallbackException,
    ORTModuleIOError,
    ORTModuleONNXModelException,
    ORTModuleTorchModelException,
)

__all__ = [
    "FallbackManager",
    "FallbackPolicy",
    "ORTModuleDeviceException",
    "ORTModuleFallbackException",
    "ORTModuleIOError",
    "ORTModuleONNXModelException",
    "ORTModuleTorchModelException",
    "parse_fallback_policy",
]

logger = logging.getLogger("ortrain.ortmodule")


def parse_fallback_policy(text: str) -> FallbackPolicy:
    policy = FallbackPolicy.FALLBACK_DISABLE
    for part in text.split("|"):
        name = part.strip()
        # Upstream documents both "FALLBACK_DISABLE" and "FallbackPolicy.FALLBACK_DISABLE".
        name = name.removeprefix("FallbackPolicy.")
        try:
            policy |= FallbackPolicy[name]
        except KeyError:
            # Iterating a Flag skips its zero member, FALLBACK_DISABLE: name it first.
            valid = ", ".join(["FALLBACK_DISABLE", *(p.name for p in FallbackPolicy if p.name)])
            raise ValueError(f"ORTMODULE_FALLBACK_POLICY has unknown policy {name!r}; use {valid}") from None
    return policy


class FallbackManager:
    """Decides, once per failure, whether to go on in PyTorch, and warns exactly once."""

    def __init__(self, policy: FallbackPolicy) -> None:
        self.policy = policy
        self.reason: ORTModuleFallbackException | None = None
        # Graph keys whose capture failed while other graphs of the model run (see handle_one_graph).
        self.graphs_in_pytorch: dict[Hashable, ORTModuleFallbackException] = {}

    @property
    def active(self) -> bool:
        return self.reason is not None or self.policy.forces_torch()

    def handle(self, error: ORTModuleFallbackException) -> None:
        """Record ``error`` and return if the policy allows PyTorch to take over; raise it otherwise."""
        if not (self.policy & error.policy):
            raise error
        self.reason = error
        logger.warning(
            "ORTModule could not run this model on ONNX Runtime and trains it in PyTorch instead "
            "(ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE makes this an error). Cause: %s",
            error,
        )

    def handle_one_graph(self, key: Hashable, error: ORTModuleFallbackException) -> bool:
        """A capture failed for one graph key while the model's other graphs run on ONNX Runtime
        (a force-field model, ``autograd.grad`` inside its forward, captures for training and fails
        in ``eval()``): under a policy that allows falling back, calls with that key run in PyTorch
        and the others stay; until wave 42 the model trained in PyTorch for good. False where the
        policy forbids it."""
        if not (self.policy & error.policy):
            return False
        self.graphs_in_pytorch[key] = error
        logger.warning(
            "ORTModule could not capture this call's graph, whose calls run in PyTorch from now on; "
            "the model's other graphs stay on ONNX Runtime "
            "(ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE makes this an error). Cause: %s",
            error,
        )
        return True
