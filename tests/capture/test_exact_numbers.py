"""Exact floats as the guards compare them: equal only to the same value, sign of zero and NaN
included, with hashes that agree (they are dict keys at every call)."""

from __future__ import annotations

from ortrain.capture.exact_numbers import ExactFloat


def test_equal_exact_floats_hash_alike_and_signed_zeros_differ() -> None:
    nan_a, nan_b = ExactFloat(float("nan")), ExactFloat(float("-nan"))
    assert nan_a == nan_b and hash(nan_a) == hash(nan_b) and len({nan_a, nan_b}) == 1
    assert ExactFloat(0.0) != ExactFloat(-0.0) and len({ExactFloat(0.0), ExactFloat(-0.0)}) == 2
    assert ExactFloat(1.5) != 1.5 and {ExactFloat(1.5): 1}[ExactFloat(1.5)] == 1
