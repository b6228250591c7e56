"""What a capture with symbolic sizes assumed about them, checked before each call.

Tracing with symbolic sizes records in its shape environment every fact about the sizes that the
model's Python relied on: a branch such as ``if x.shape[1] > 16: x = x[:, :16]``, two sizes
taken as equal, a size taken to be neither 0 nor 1 (broadcasting). The captured graph computes
the model only for inputs that satisfy them all; run on others it would fail in ONNX Runtime or,
worse, compute something else without a word (the branch not taken). So each dynamic capture
keeps its guards as one Python expression over the inputs' sizes, compiled once, and ORTModule
uses a graph only for inputs that pass it; others are captured again, with guards of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP


class SizeGuards:
    """The guards of one capture: ``guards(inputs)`` says whether its graphs hold for ``inputs``."""

    def __init__(self, code: str | None) -> None:
        self.code = code  # None: nothing assumed (fixed sizes are checked apart)
        self._compiled = compile(code, "<ortrain size guards>", "eval") if code else None

    @classmethod
    def of(cls, fake_inputs: Sequence[Any]) -> SizeGuards:
        """The guards that the shape environment of ``fake_inputs`` recorded while they were traced."""
        shape_env = next(
            (t.fake_mode.shape_env for t in fake_inputs if getattr(t, "fake_mode", None) is not None), None
        )
        if shape_env is None:
            return cls(None)
        return cls(shape_env.produce_guards_expression(list(fake_inputs)))

    def __call__(self, inputs: Sequence[torch.Tensor]) -> bool:
        if self._compiled is None:
            return True
        frame = {"L": {f"t{i}": tensor for i, tensor in enumerate(inputs)}}
        try:
            return bool(eval(self._compiled, SYMPY_INTERP, frame))  # torch's own guard code
        except ArithmeticError:
            # A guard computed over sizes this capture never assumed (``2 % (2 * (T // 3))`` for a
            # T of 2, checked before the ``6 <= T`` beside it): such inputs are not the capture's,
            # and go to a new one (until wave 41 the step raised ZeroDivisionError).
            return False

    def __getstate__(self) -> dict[str, Any]:
        return {"code": self.code}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["code"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"SizeGuards({self.code!r})"
