"""ortrain: train PyTorch models on ONNX Runtime.

The top-level names load lazily: ``import ortrain.utils.data`` or ``ortrain.optim`` should not pay
for importing the capture and export machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DebugOptions", "LogLevel", "ORTModule"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("ortrain.ortmodule"), name)
    raise AttributeError(f"module 'ortrain' has no attribute {name!r}")
