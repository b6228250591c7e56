"""DistributedDataParallel over ORTModule averages ORT-computed gradients like over the plain model."""

from __future__ import annotations

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
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), "2", port, str(outs[r])]) for r in range(2)
    ]
    for proc in procs:
        assert proc.wait(timeout=240) == 0
    for out in outs:
        assert float(out.read_text()) < 1e-6
