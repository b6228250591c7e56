"""The user-facing wrapper, at the import path upstream used (``onnxruntime.training.ortmodule``)."""

# First: TorchDynamo's import, without Triton on a machine with no GPU (capture/triton_import.py).
from ortrain.capture.triton_import import import_dynamo
from ortrain.ortmodule.options import triton_wanted_on_cpu

import_dynamo(keep_triton=triton_wanted_on_cpu())

# Registers torch.compile(backend="ortrain") (also an entry point, for an installed ortrain).
import ortrain.backend  # noqa: E402, F401
from ortrain.ortmodule._custom_autograd_function import enable_custom_autograd_support  # noqa: E402
from ortrain.ortmodule.fallback import (  # noqa: E402
    FallbackPolicy,
    ORTModuleDeviceException,
    ORTModuleFallbackException,
    ORTModuleIOError,
    ORTModuleONNXModelException,
    ORTModuleTorchModelException,
)
from ortrain.ortmodule.options import DebugOptions, LogLevel  # noqa: E402
from ortrain.ortmodule.ortmodule import ORTModule  # noqa: E402

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
