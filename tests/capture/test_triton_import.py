"""ortrain's import of TorchDynamo leaves Triton out on a machine without a GPU (wave 32).

Each check imports ortrain in a fresh interpreter: what a process has imported cannot be undone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU keeps Triton"),
]

_PROBE = """
import json, sys
import ortrain.ortmodule
loaded = "triton" in sys.modules
import triton  # still importable by the user's code
print(json.dumps({"loaded": loaded, "dynamo": "torch._dynamo" in sys.modules, "version": triton.__version__}))
"""


def _probe(**env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if k not in ("ORTMODULE_USE_TRITON", "TRITON_INTERPRET")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_triton_is_not_imported_without_a_gpu_and_stays_importable() -> None:
    found = _probe()
    assert found["dynamo"] is True
    assert found["loaded"] is False
    assert found["version"]


def test_asking_for_triton_keeps_it() -> None:
    assert _probe(ORTMODULE_USE_TRITON="1")["loaded"] is True


@pytest.mark.parametrize("variable", ["ORTMODULE_USE_TRITON", "TRITON_INTERPRET"])
def test_either_variable_asks_for_triton(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """What the fresh interpreter above decides from (one probe is enough for the import itself)."""
    from ortrain.ortmodule.options import triton_wanted_on_cpu

    monkeypatch.delenv("ORTMODULE_USE_TRITON", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_wanted_on_cpu() is False
    monkeypatch.setenv(variable, "1")
    assert triton_wanted_on_cpu() is True
