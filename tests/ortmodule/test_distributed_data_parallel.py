"""DistributedDataParallel over ORTModule averages ORT-computed gradients like over the plain model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_ddp_worker.py")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_ddp_wrapping_ortmodule_matches_ddp_wrapping_the_model(tmp_path: Path) -> None:
    port = _free_port()
    outs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", port, str(outs[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        logs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    for out in outs:
        assert float(out.read_text()) < 1e-6
