"""The complementary error function family, written so that its tails survive in float32.

onnxscript translates ``erfc(x)`` as ``1 - Erf(x)``, which is 0 for every x above ~3.9 in float32
(erfc(5) is 1.5e-12), and ``erfcx(x)`` as ``exp(x²)·(1 - Erf(x))``: 0, inf or NaN for large x.
``special.log_ndtr`` goes through ``erfcx`` and came out ``-inf`` where PyTorch gives -36 (a wrong
value without an error). Here ``erfcx`` on x >= 0 is the Chebyshev-fitted exponent of Numerical
Recipes' ``erfcc`` (relative error below 1.2e-7 for every x >= 0); the rest follows from it with
exact identities.
"""

from __future__ import annotations

import math

import torch

# Numerical Recipes (2nd ed., §6.2) erfcc: erfc(z) = t·exp(-z² + P(t)), t = 1 / (1 + z/2), z >= 0.
_ERFCC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
          1.48851587, -0.82215223, 0.17087277)  # fmt: skip


def _erfcx_nonnegative(z: torch.Tensor) -> torch.Tensor:
    """exp(z²)·erfc(z) for z >= 0."""
    t = 1.0 / (1.0 + 0.5 * z)
    poly = torch.full_like(z, _ERFCC[-1])
    for c in reversed(_ERFCC[:-1]):
        poly = c + t * poly
    return t * torch.exp(poly)


def erfcx(x: torch.Tensor) -> torch.Tensor:
    """Scaled complementary error function; for x < 0, erfcx(x) = 2·exp(x²) - erfcx(-x)
    (inf below about -9.3 in float32, as PyTorch)."""
    scaled = _erfcx_nonnegative(x.abs())
    return torch.where(x >= 0, scaled, 2.0 * torch.exp(x * x) - scaled)


def erfc(x: torch.Tensor) -> torch.Tensor:
    """erfc(x) = erfcx(|x|)·exp(-x²) for x >= 0, and 2 - that for x < 0."""
    tail = _erfcx_nonnegative(x.abs()) * torch.exp(-x * x)
    return torch.where(x >= 0, tail, 2.0 - tail)


def log_ndtr(x: torch.Tensor) -> torch.Tensor:
    """log of the standard normal CDF, as PyTorch's reference: through erfcx below 1 (so that the
    far left tail is -t² + log(erfcx(-t)/2), never log(0)), log1p(-erfc/2) above."""
    t = x * (1.0 / math.sqrt(2.0))
    left = torch.log(erfcx(-t) / 2.0) - t * t
    right = torch.log1p(-erfc(t) / 2.0)
    return torch.where(x < 1.0, left, right)
