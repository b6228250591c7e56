"""``enable_custom_autograd_support``: upstream's switch for opaque ``torch.autograd.Function``s.

On (the default, ``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=1``), each Function call in a model runs in
PyTorch as a ``PythonOp`` between ONNX Runtime segments. Off, Functions are traced into the graphs
("inline"), so their computation runs in ONNX Runtime; that needs traceable Functions. Calling
this function overrides the environment variable for every ``ORTModule`` from then on, and the
switch can be flipped back: graphs captured under the other setting are not reused.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("ortrain.ortmodule")

_override: bool | None = None


def enable_custom_autograd_support(enable: bool = True) -> None:
    """Run ``torch.autograd.Function``s opaquely in PyTorch (True) or trace them inline (False)."""
    global _override
    _override = bool(enable)
    logger.info("custom autograd Function support %s", "enabled" if enable else "disabled (inline)")


def custom_autograd_enabled(default: bool) -> bool:
    """The setting in force: the last ``enable_custom_autograd_support`` call, else ``default``
    (an ``ORTModule``'s ``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD``)."""
    return default if _override is None else _override
