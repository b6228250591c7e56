"""Whether a call comes from the model's own code, and from where.

A capture watches some of what the forward does through Python (reading ``os.environ``, printing)
and lets the same calls by PyTorch, ortrain, installed libraries and the standard library pass.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

_STDLIB = sysconfig.get_paths()["stdlib"]
_ORTRAIN = str(Path(__file__).resolve().parents[1])
_INSTALLED = ("site-packages", "dist-packages")


def model_code_calling(depth: int) -> str | None:
    """Where the model's own code made the call being handled (``file:line``), ``depth`` frames
    above this function's (2: the caller of the function that calls this one), past the standard
    library's frames (``os.getenv``, ``Mapping.get``; ``<frozen os>`` where Python froze them);
    None where the caller is PyTorch's, ortrain's, an installed library's or the standard
    library's."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith((_STDLIB, "<frozen ")):
        frame = frame.f_back
    if frame is None:
        return None
    filename = frame.f_code.co_filename
    if filename.startswith(("<", _ORTRAIN)) or any(part in filename for part in _INSTALLED):
        return None
    return f"{filename}:{frame.f_lineno}"
