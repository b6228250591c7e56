"""Freed memory reuse: once an ORTModule exists, a block freed at one step is reused by the next
without faulting its pages in again; the switch and the user's own malloc settings leave malloc
alone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from ortrain.ortmodule.options import user_malloc_setting

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings"
)

# Allocates and frees a 48 MiB tensor (above glibc's largest automatic mmap threshold, 32 MiB)
# as a step's activation would be, after wrapping a model, and prints the page faults per block.
_CHILD = """
import json, resource, torch
from torch import nn
import ortrain.runtime.freed_memory_reuse as reuse
from ortrain import ORTModule

ORTModule(nn.Linear(2, 2))

def faults_per_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        block = torch.ones(12 << 20)  # 48 MiB of float32
        del block
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

faults_per_block()  # the first block may fault in either case
print(json.dumps({"applied": reuse._applied, "faults": faults_per_block(), "state": reuse.describe()}))
"""


def _run_child(**variables: str) -> tuple[dict[str, object], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(variables, ORTMODULE_LOG_LEVEL="INFO")
    command = [sys.executable, "-c", _CHILD]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@glibc_only
def test_a_freed_block_is_reused_without_page_faults() -> None:
    result, log = _run_child()
    assert result["applied"] is True
    # 48 MiB is 12 288 pages: mapped afresh, every one faults; reused, none do.
    assert result["faults"] < 200, result
    assert "freed memory stays in this process for reuse" in log
    assert result["state"] == "on: freed blocks up to 256 MiB are reused (glibc malloc thresholds raised)"


@glibc_only
@pytest.mark.parametrize(
    ("variables", "state"),
    [
        # switched off
        ({"ORTMODULE_REUSE_FREED_MEMORY": "0"}, "off: ORTMODULE_REUSE_FREED_MEMORY=0"),
        # the user's own setting (here glibc's default threshold, as a user might pin it)
        (
            {"MALLOC_MMAP_THRESHOLD_": "131072"},
            "off: malloc left as configured: MALLOC_MMAP_THRESHOLD_ is set",
        ),
    ],
)
def test_malloc_left_alone_maps_each_block_again(variables: dict[str, str], state: str) -> None:
    result, log = _run_child(**variables)
    assert result["applied"] is False
    assert result["faults"] > 10_000, result
    assert "freed memory stays" not in log
    assert result["state"] == state


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, None),
        ({"MALLOC_TRIM_THRESHOLD_": "1000"}, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1000"}, "GLIBC_TUNABLES sets glibc.malloc"),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1000"}, None),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD loads jemalloc"),
    ],
)
def test_user_malloc_setting(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], expected: str | None
) -> None:
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert user_malloc_setting() == expected
