"""The user-facing wrapper, at the import path upstream used (``onnxruntime.training.ortmodule``)."""

# Registers torch.compile(backend="ortrain") (also an entry point, for an installed ortrain).
import ortrain.backend  # noqa: F401
from ortrain.ortmodule._custom_autograd_function import enable_custom_autograd_support
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
    "enable_custom_autograd_support",
]
