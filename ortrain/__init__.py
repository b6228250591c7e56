"""ortrain: train PyTorch models on ONNX Runtime."""

from ortrain.ortmodule import DebugOptions, LogLevel, ORTModule

__all__ = ["DebugOptions", "LogLevel", "ORTModule"]
__version__ = "0.1.0"
