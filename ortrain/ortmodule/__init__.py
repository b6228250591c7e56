"""The user-facing wrapper, at the import path upstream used (``onnxruntime.training.ortmodule``)."""

from ortrain.ortmodule.fallback import (
    FallbackPolicy,
    ORTModuleDeviceException,
    ORTModuleFallbackException,
    ORTModuleIOError,
    ORTModuleONNXModelException,
    ORTModuleTorchModelException,
)
from ortrain.ortmodule.options import DebugOptions, LogLevel
from ortrain.ortmodule.ortmodule import ORTModule

__all__ = [
    "DebugOptions",
    "FallbackPolicy",
    "LogLevel",
    "ORTModule",
    "ORTModuleDeviceException",
    "ORTModuleFallbackException",
    "ORTModuleIOError",
    "ORTModuleONNXModelException",
    "ORTModuleTorchModelException",
]
