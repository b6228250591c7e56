"""Guidelines §5 all together: ORTModule + FusedAdam + deepspeed.initialize + FP16_Optimizer.

Two ranks over gloo on DeepSpeed's CPU accelerator, four steps on rank-specific data, parameters
compared with the same recipe without ORTModule. One launch runs every case (DeepSpeed's start-up
dominates); each test reads its case. ORTModule runs with FALLBACK_DISABLE, so a case passes only
if ONNX Runtime computed the gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason='deepspeed not installed (pip install "ortrain[deepspeed]")',
)

WORKER = Path(__file__).with_name("_deepspeed_worker.py")
CASES = ("1:fp32", "2:fp32", "3:fp32", "2:bf16")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("deepspeed")
    repo = Path(__file__).resolve().parents[2]
    port = _free_port()
    outs = [tmp / f"rank{r}.json" for r in range(2)]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            DS_ACCELERATOR="cpu",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            GLOO_SOCKET_IFNAME="lo",
            ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE",
            PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
        )
        command = [sys.executable, str(WORKER), ",".join(CASES), str(outs[rank])]
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    try:
        logs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-4000:]
    by_rank = [json.loads(out.read_text()) for out in outs]
    return {case: [ranks[case] for ranks in by_rank] for case in CASES}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_recipe_with_ortmodule_matches_the_recipe_without(results: dict[str, Any], stage: int) -> None:
    for rank in results[f"{stage}:fp32"]:
        assert "error" not in rank, rank.get("error")
        assert rank["ran_on_ort"] and rank["optimizer"] == "DeepSpeedZeroOptimizer"
        assert rank["fp16_optimizer_patched"]
        assert rank["diff"] < 1e-5, rank
        for got, want in zip(rank["losses"]["ortrain"], rank["losses"]["eager"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want)


def test_zero_stage_3(results: dict[str, Any]) -> None:
    rank = results["3:fp32"][0]
    if "error" in rank:
        # ZeRO-3 partitions each parameter and gathers it in forward hooks of every submodule; the
        # capture runs those all-gathers on fake tensors and fails. (FP16_Optimizer also supports
        # ZeRO 1 and 2 only, as upstream's did.) Under the default policy the model trains on in
        # PyTorch after one warning.
        assert "capture failed" in rank["error"]
        pytest.skip(f"ZeRO stage 3 with ORTModule is not supported yet: {rank['error'][:300]}")
    assert rank["diff"] < 1e-5, rank


def test_bf16_recipe(results: dict[str, Any]) -> None:
    rank = results["2:bf16"][0]
    if "error" in rank:
        # DeepSpeed runs bf16 on the CPU (its CPU accelerator refuses fp16), but ONNX Runtime's CPU
        # execution provider has no bfloat16 kernels for Gemm, Div and most other operators; under
        # FALLBACK_DISABLE the per-operator fallback to PyTorch that would run them is refused.
        assert "ONNX Runtime cannot run" in rank["error"], rank["error"]
        assert "FALLBACK_UNSUPPORTED_ONNX_MODEL" in rank["error"], rank["error"]
        pytest.skip(f"bf16 needs kernels ONNX Runtime's CPU provider lacks: {rank['error'][:300]}")
    assert rank["diff"] < 1e-2, rank
