"""onnxscript's no-op rewrite rules, matching their constants exactly.

onnxscript's default rewrite rules remove ``x + 0``, ``x - 0``, ``x * 1`` and ``x / 1``. Their
patterns' constants match with ``math.isclose(value, expected, rel_tol=1e-5, abs_tol=1e-8)``, so
``x + 1e-8`` and ``x + 1e-12`` matched ``x + 0`` and the addition was removed: the epsilon of
``torch.log(p + 1e-8)``, of ``x / (norm + 1e-12)`` or of ``cosine_embedding_loss`` (whose
``1e-12`` keeps a zero vector's cosine at 0) vanished from every graph ONNX Runtime ran, and
eager's finite losses became ``-inf`` or NaN there (wave 35). ``x * 1.000001`` lost its product
the same way.

Each rule whose pattern holds a constant gets a copy whose constants match only their own value,
and the one removing ``x + 0`` is left out (:func:`adds_zero`).
In onnxscript 0.7 those are the four no-op rules (and their commuted forms) and two shape rules,
whose integer constants were exact already; fusions check their constants in conditions of their
own, and a fusion replaces a formula by the same formula where these rules removed an operation.
"""

from __future__ import annotations

import copy
from typing import Any

from onnxscript.rewriter import _pattern_ir


def _constants(rule: Any) -> list[Any]:
    pattern = getattr(getattr(rule, "_matcher", None), "pattern", None)
    if pattern is None:
        return []
    return [value for node in pattern for value in node.inputs if isinstance(value, _pattern_ir.Constant)]


def adds_zero(rule: Any) -> bool:
    """The rule that removes ``x + 0`` (either order): not a no-op where ``x`` is -0.0, which
    PyTorch's addition makes +0.0 (``1 / (w + 0.0)`` of a -0.0 weight: +inf in eager, -inf with the
    rule; ``atan2(w + 0.0, -1)``: π against -π; wave 41). ``x - 0``, ``x * 1`` and ``x / 1`` keep
    every bit, signed zeros included."""
    nodes = list(getattr(getattr(rule, "_matcher", None), "pattern", None) or ())
    if len(nodes) != 1 or str(getattr(nodes[0], "op", "")) != "Add":
        return False
    return any(getattr(c, "_value", None) == 0 for c in _constants(rule))


def with_exact_constants(rule: Any) -> Any:
    """``rule``, or a copy of it whose pattern's constants match exactly when it has any."""
    if not _constants(rule):
        return rule
    exact = copy.deepcopy(rule)
    for constant in _constants(exact):
        constant._rel_tol = 0.0
        constant._abs_tol = 0.0
    return exact
