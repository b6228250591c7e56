"""Fallback policies and the exceptions every layer raises for them.

This module sits below capture, export, runtime and ortmodule so that any of them can raise a
failure the fallback policy decides about without importing the user-facing wrapper.
``ortrain.ortmodule.fallback`` re-exports these names (upstream's import path).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator


class FallbackPolicy(enum.IntFlag):
    FALLBACK_DISABLE = 0
    FALLBACK_FORCE_TORCH_FORWARD = 1
    FALLBACK_FORCE_TORCH_BACKWARD = 2
    FALLBACK_UNSUPPORTED_DEVICE = 4
    FALLBACK_UNSUPPORTED_DATA = 8
    FALLBACK_UNSUPPORTED_TORCH_MODEL = 16
    FALLBACK_UNSUPPORTED_ONNX_MODEL = 32
    FALLBACK_BAD_INITIALIZATION = 64

    @classmethod
    def default(cls) -> FallbackPolicy:
        return (
            cls.FALLBACK_UNSUPPORTED_DEVICE
            | cls.FALLBACK_UNSUPPORTED_DATA
            | cls.FALLBACK_UNSUPPORTED_TORCH_MODEL
            | cls.FALLBACK_UNSUPPORTED_ONNX_MODEL
        )

    def forces_torch(self) -> bool:
        return bool(
            self
            & (FallbackPolicy.FALLBACK_FORCE_TORCH_FORWARD | FallbackPolicy.FALLBACK_FORCE_TORCH_BACKWARD)
        )


class ORTModuleFallbackException(RuntimeError):
    """A failure a fallback policy decides about; ``policy`` is the flag that allows falling back."""

    policy: FallbackPolicy = FallbackPolicy.FALLBACK_DISABLE


class ORTModuleDeviceException(ORTModuleFallbackException):
    policy = FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE


class ORTModuleIOError(ORTModuleFallbackException):
    policy = FallbackPolicy.FALLBACK_UNSUPPORTED_DATA


class GeneratorInputError(ORTModuleIOError):
    """A call passes a ``torch.Generator`` (``forward(x, generator=g)``): that call runs in PyTorch,
    and the model keeps its graphs for the calls without one. ``where``: the input, in words."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"ORTModule cannot pass {where} (a torch.Generator) to a captured graph; hold the "
            "generator on the model (an attribute the forward reads), or let "
            "ORTMODULE_FALLBACK_POLICY include FALLBACK_UNSUPPORTED_DATA, under which the calls "
            "that pass one run in PyTorch"
        )
        self.where = where


class ORTModuleTorchModelException(ORTModuleFallbackException):
    policy = FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL


class ORTModuleONNXModelException(ORTModuleFallbackException):
    policy = FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL


def exception_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then what caused it (or what it was raised while handling), and so on, each once:
    a capture wraps the errors it meets in its own, and the one that decides is often below."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
