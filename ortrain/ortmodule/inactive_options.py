"""One message per process for each guideline variable that is set but cannot act in this build,
and for each ``ORTMODULE_*`` variable set that ortrain does not read at all.

Upstream's Triton variables (guidelines §6) drive executors that run on NVIDIA GPUs;
ortrain accepts and validates them, and says once, at WARNING, why a value the user set does
nothing here, rather than ignoring it silently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from ortrain.ortmodule.options import RuntimeOptions, unknown_variable_messages

logger = logging.getLogger("ortrain.ortmodule")

_announced: set[str] = set()


def _nvidia_gpu() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


def inactive_option_messages(options: RuntimeOptions) -> dict[str, str]:
    """Variable name → why its value does nothing here (only for variables set to act)."""
    messages: dict[str, str] = {}
    if options.use_triton:
        if _nvidia_gpu():
            why = "ortrain's Triton executor is not part of this release yet; ONNX Runtime runs the graphs"
        else:
            why = "Triton kernels need an NVIDIA GPU (CUDA), none is available; ONNX Runtime runs the graphs"
        messages["ORTMODULE_USE_TRITON"] = f"ORTMODULE_USE_TRITON=1 has no effect: {why}."
    until = "until ortrain's Triton executor exists, so this setting is accepted but unused"
    if options.triton_debug:
        messages["ORTMODULE_TRITON_DEBUG"] = (
            f"ORTMODULE_TRITON_DEBUG=1 has no effect {until}; no triton_debug folder is written."
        )
    return messages


def announce_inactive_options(options: RuntimeOptions) -> None:
    """Log each message of :func:`inactive_option_messages`, and one for each ``ORTMODULE_*``
    variable set that ortrain does not read (a typo), once per process."""
    messages = {**inactive_option_messages(options), **unknown_variable_messages()}
    for name, message in messages.items():
        if name not in _announced:
            _announced.add(name)
            logger.warning(message)


def mark_announced(names: Iterable[str]) -> None:
    """Take these variables as said already (``ortrain doctor`` lists them as findings): until
    wave 53 its training check's ``ORTModule`` repeated each one on standard error."""
    _announced.update(names)
