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


def _cot_pi(r: torch.Tensor) -> torch.Tensor:
    """cot(πr) for |r| <= 1/2: ``1 / tan(πr)`` near 0, and ``tan(π(1/2 - |r|))`` away from it,
    which is 0 at the half-integers (``1 / tan(π/2)`` was -4.4e-8 in float32, and
    polygamma(2, -10.5) 3.3e-4 relative off eager, wave 44). ``1/2 - |r|`` is exact there."""
    magnitude = r.abs()
    far = torch.sign(r) * torch.tan(math.pi * (0.5 - magnitude))
    return torch.where(magnitude <= 0.25, 1.0 / torch.tan(math.pi * r), far)


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
    cot = _cot_pi(_reduced(x))
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
    if n == 0:  # PyTorch: copysign(inf, -x) at ±0 (+inf at -0.0), NaN at the negative integers
        at_zero = torch.where(1.0 / x < 0, math.inf, -math.inf)  # 1 / -0.0 is -inf
        return torch.where(pole, torch.where(x == 0, at_zero, math.nan), value)
    return torch.where(pole, (-1.0) ** (n + 1) * math.inf, value)  # PyTorch: ±inf by n's parity


def digamma(x: torch.Tensor) -> torch.Tensor:
    return polygamma(0, x)


def mvlgamma(x: torch.Tensor, p: int) -> torch.Tensor:
    """Multivariate log-gamma: the sum of log-gammas, for every element, as PyTorch's kernel (which
    no longer checks that elements are above (p - 1)/2: mvlgamma(0.5, p=2) is inf, of 0.4 is
    3.738; this decomposition made them NaN until wave 53)."""
    value = torch.full_like(x, p * (p - 1) / 4 * math.log(math.pi))
    for j in range(p):
        value = value + lgamma(x - j / 2)
    return value


# ndtri: the inverse of the standard normal CDF. The exporter lowers it to ``prims.ndtri``, which
# has no ONNX translation. PyTorch's kernel evaluates Cephes' rational approximations (Cephes Math
# Library, 3-clause BSD; the coefficients are Cephes' published constants): one in y - 1/2 for
# the centre (|y - 1/2| <= 3/8 ... exp(-2) to 1 - exp(-2)), two in 1/sqrt(-2·log y) for the tails.
# Polynomial coefficients, highest power first.
_NDTRI_P0 = (-5.99633501014107895267e1, 9.80010754185999661536e1, -5.66762857469070293439e1,
             1.39312609387279679503e1, -1.23916583867381258016e0)  # fmt: skip
_NDTRI_Q0 = (1.0, 1.95448858338141759834e0, 4.67627912898881538453e0, 8.63602421390890590575e1,
             -2.25462687854119370527e2, 2.00260212380060660359e2, -8.20372256168333339912e1,
             1.59056225126211695515e1, -1.18331621121330003142e0)  # fmt: skip
_NDTRI_P1 = (4.05544892305962419923e0, 3.15251094599893866154e1, 5.71628192246421288162e1,
             4.40805073893200834700e1, 1.46849561928858024014e1, 2.18663306850790267539e0,
             -1.40256079171354495875e-1, -3.50424626827848203418e-2, -8.57456785154685413611e-4)  # fmt: skip
_NDTRI_Q1 = (1.0, 1.57799883256466749731e1, 4.53907635128879210584e1, 4.13172038254672030440e1,
             1.50425385692907503408e1, 2.50464946208309415979e0, -1.42182922854787788574e-1,
             -3.80806407691578277194e-2, -9.33259480895457427372e-4)  # fmt: skip
_NDTRI_P2 = (3.23774891776946035970e0, 6.91522889068984211695e0, 3.93881025292474443415e0,
             1.33303460815807542389e0, 2.01485389549179081538e-1, 1.23716634817820021358e-2,
             3.01581553508235416007e-4, 2.65806974686737550832e-6, 6.23974539184983293730e-9)  # fmt: skip
_NDTRI_Q2 = (1.0, 6.02427039364742014255e0, 3.67983563856160859403e0, 1.37702099489081330271e0,
             2.16236993594496635890e-1, 1.34204006088543189037e-2, 3.28014464682127739104e-4,
             2.89247864745380683936e-6, 6.79019408009981274425e-9)  # fmt: skip
_EXP_MINUS_2 = 0.13533528323661269189


def _polynomial(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    value = torch.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        value = value * x + c
    return value


def ndtri(y: torch.Tensor) -> torch.Tensor:
    """x with Φ(x) = y: -inf at 0, inf at 1, NaN outside [0, 1], as PyTorch."""
    upper = y > 1.0 - _EXP_MINUS_2
    tail = torch.where(upper, 1.0 - y, y)  # the tail nearest y, as a probability <= exp(-2)
    centre = tail > _EXP_MINUS_2
    # Centre: y - 1/2 with |y - 1/2| <= 1/2 - exp(-2).
    u = y - 0.5
    u2 = u * u
    middle = (u + u * (u2 * _polynomial(u2, _NDTRI_P0) / _polynomial(u2, _NDTRI_Q0))) * math.sqrt(2 * math.pi)
    # Tails: x = sqrt(-2·log p) >= 2 where p <= exp(-2); elsewhere a harmless 1/2 stands in.
    p = torch.where(centre, torch.full_like(tail, 0.5), tail)
    x = torch.sqrt(-2.0 * torch.log(p))
    z = 1.0 / x
    near = z * _polynomial(z, _NDTRI_P1) / _polynomial(z, _NDTRI_Q1)
    far = z * _polynomial(z, _NDTRI_P2) / _polynomial(z, _NDTRI_Q2)
    value = x - torch.log(x) / x - torch.where(x < 8.0, near, far)
    value = torch.where(upper, value, -value)
    value = torch.where(centre, middle, value)
    value = torch.where(y == 0.0, -math.inf, value)
    value = torch.where(y == 1.0, math.inf, value)
    return torch.where((y < 0.0) | (y > 1.0), math.nan, value)
