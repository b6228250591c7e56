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


# The gamma family (lgamma, digamma, polygamma) has no ONNX translation: the exporter lowers
# them to prims that have none. Each is written for x >= 1/2 by stepping x up to where the
# asymptotic (Stirling) series is exact in float32, and below 1/2 by the reflection formula
# through sin/tan/cot of π·(x - round(x)), which keeps its accuracy for large |x|.
_SHIFT = 8  # x + 8 >= 8.5: the series' next terms are below float32's precision
# Bernoulli numbers B2, B4, ..., B10.
_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66)


def _reduced(x: torch.Tensor) -> torch.Tensor:
    return x - torch.round(x)


def lgamma(x: torch.Tensor) -> torch.Tensor:
    """log|Γ(x)|; inf at the poles 0, -1, -2, ..., as PyTorch."""
    upper = torch.where(x >= 0.5, x, 1.0 - x)  # >= 1/2 either way
    w = upper + _SHIFT
    series = (w - 0.5) * torch.log(w) - w + 0.5 * math.log(2 * math.pi)
    inverse, inverse_sq = 1.0 / w, 1.0 / (w * w)
    power = inverse
    for k, b in enumerate(_BERNOULLI[:4], start=1):
        series = series + b / (2 * k * (2 * k - 1)) * power
        power = power * inverse_sq
    falling = torch.zeros_like(upper)
    for k in range(_SHIFT):
        falling = falling + torch.log(upper + k)
    value = series - falling
    sine = torch.sin(math.pi * _reduced(x)).abs()
    reflected = math.log(math.pi) - torch.log(sine) - value
    return torch.where(x >= 0.5, value, reflected)


def _polygamma_upper(n: int, x: torch.Tensor) -> torch.Tensor:
    """ψ⁽ⁿ⁾(x) for x >= 1/2, n >= 0."""
    w = x + _SHIFT
    if n == 0:
        series = torch.log(w) - 0.5 / w
        inverse_sq = 1.0 / (w * w)
        power = inverse_sq
        for k, b in enumerate(_BERNOULLI, start=1):
            series = series - b / (2 * k) * power
            power = power * inverse_sq
        steps = torch.zeros_like(x)
        for k in range(_SHIFT):
            steps = steps + 1.0 / (x + k)
        return series - steps
    # ψ⁽ⁿ⁾(w) ~ (-1)^(n+1) [(n-1)!/wⁿ + n!/(2w^(n+1)) + Σ B2k (2k+n-1)!/((2k)! w^(2k+n))]
    sign = (-1.0) ** (n + 1)
    inverse = 1.0 / w
    series = math.factorial(n - 1) * inverse**n + math.factorial(n) / 2 * inverse ** (n + 1)
    for k, b in enumerate(_BERNOULLI, start=1):
        coefficient = b * math.factorial(2 * k + n - 1) / math.factorial(2 * k)
        series = series + coefficient * inverse ** (2 * k + n)
    steps = torch.zeros_like(x)
    for k in range(_SHIFT):
        steps = steps + (1.0 / (x + k)) ** (n + 1)
    return sign * math.factorial(n) * steps + sign * series


def _cot_derivative(n: int, x: torch.Tensor) -> torch.Tensor:
    """dⁿ/dxⁿ cot(πx), as πⁿ·Pₙ(cot πx) with P₀(c) = c and Pₖ₊₁ = -(1 + c²)·Pₖ'."""
    coefficients = [0.0, 1.0]  # P₀(c) = c, lowest power first
    for _ in range(n):
        derivative = [i * c for i, c in enumerate(coefficients)][1:]
        product = [0.0] * (len(derivative) + 2)
        for i, c in enumerate(derivative):
            product[i] -= c
            product[i + 2] -= c
        coefficients = product
    cot = 1.0 / torch.tan(math.pi * _reduced(x))
    value = torch.zeros_like(x)
    for c in reversed(coefficients):
        value = value * cot + c
    return value * math.pi**n


def polygamma(n: int, x: torch.Tensor) -> torch.Tensor:
    """ψ⁽ⁿ⁾(x); below 1/2 by ψ⁽ⁿ⁾(1-x) + (-1)^(n+1)·ψ⁽ⁿ⁾(x) = (-1)ⁿ·π·dⁿ/dxⁿ cot(πx)."""
    upper = _polygamma_upper(n, torch.where(x >= 0.5, x, 1.0 - x))
    reflected = (-1.0) ** (n + 1) * ((-1.0) ** n * math.pi * _cot_derivative(n, x) - upper)
    value = torch.where(x >= 0.5, upper, reflected)
    pole = (x <= 0) & (x == torch.floor(x))
    if n == 0:  # PyTorch: -inf at 0, NaN at the negative integers
        return torch.where(pole, torch.where(x == 0, -math.inf, math.nan), value)
    return torch.where(pole, (-1.0) ** (n + 1) * math.inf, value)  # PyTorch: ±inf by n's parity


def digamma(x: torch.Tensor) -> torch.Tensor:
    return polygamma(0, x)


def mvlgamma(x: torch.Tensor, p: int) -> torch.Tensor:
    """Multivariate log-gamma. PyTorch raises when an element is not above (p - 1)/2, a check on
    values that a graph cannot make: those elements are NaN here instead."""
    value = torch.full_like(x, p * (p - 1) / 4 * math.log(math.pi))
    for j in range(p):
        value = value + lgamma(x - j / 2)
    return torch.where(x > (p - 1) / 2, value, torch.full_like(x, math.nan))
