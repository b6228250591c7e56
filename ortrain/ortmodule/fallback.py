"""Fallback policies (``ORTMODULE_FALLBACK_POLICY``) and the exceptions they decide about.

When a model cannot be captured, exported or run, ortrain either keeps training it in PyTorch
(after one warning naming the cause) or raises, depending on the policy. Policy names are
upstream's, alone or joined with ``|``. The policy enum and the exceptions live in
:mod:`ortrain.errors` (below every layer) and are re-exported here.
"""

from __future__ import annotations

import logging

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
