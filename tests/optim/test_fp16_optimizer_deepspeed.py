"""FP16_Optimizer on DeepSpeed's real ZeRO stage 2 optimizer, run on DeepSpeed's CPU accelerator.

Covered: detection by class name, the same object returned, the three methods replaced on the instance,
their results equal to DeepSpeed's own methods on the optimizer's real partitioned gradients (clean, with
inf, with NaN; L2 and inf norms, including the -1 sentinel), and three training steps with gradient
clipping matching an unpatched twin exactly. The CPU accelerator supports bf16 but not fp16, so the run is
bf16 (no dynamic loss scale); the fp16 loss-scale path and GPU speed need a GPU machine.

DeepSpeed initialises torch.distributed, so the check runs in a subprocess (single rank, gloo).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"
)

SCRIPT = textwrap.dedent(
    """
    import math
    import torch
    import deepspeed
    from ortrain.optim.fp16_optimizer import FP16_Optimizer

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
               "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        return engine, optimizer

    ea, oa = build()
    eb, ob = build()
    cls = type(oa)
    name = f"{cls.__module__}.{cls.__qualname__}"
    assert name == "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", name
    assert FP16_Optimizer(oa) is oa
    for name in ("has_overflow_serial", "has_overflow_partitioned_grads_serial", "get_grad_norm_direct"):
        assert name in vars(oa), name  # bound on the instance, the class is untouched
        assert name not in vars(ob)

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for step in range(3):
        for e in (ea, eb):
            e.backward(e(x).float().pow(2).mean())
        groups = range(len(oa.bit16_groups))
        got = oa.has_overflow_partitioned_grads_serial()
        want = cls.has_overflow_partitioned_grads_serial(oa)
        assert got.shape == want.shape and bool(got) == bool(want) == False
        for norm_type in (2, math.inf):
            for i in groups:
                args = (oa.averaged_gradients[i], oa.params_in_partition[i], norm_type)
                got, want = oa.get_grad_norm_direct(*args), cls.get_grad_norm_direct(oa, *args)
                torch.testing.assert_close(got, want)
        if step == 1:
            grad = oa.averaged_gradients[0][0]
            saved = grad.clone()
            for bad in (float("inf"), float("nan")):
                grad.view(-1)[0] = bad
                assert bool(oa.has_overflow_partitioned_grads_serial())
                assert bool(cls.has_overflow_partitioned_grads_serial(oa))
                args = (oa.averaged_gradients[0], oa.params_in_partition[0])
                got, want = oa.get_grad_norm_direct(*args), cls.get_grad_norm_direct(oa, *args)
                assert got.item() == want.item() == -1
            grad.copy_(saved)
        ea.step()
        eb.step()

    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    params[0].grad = torch.randn(5)
    assert not bool(oa.has_overflow_serial(params)) and not bool(cls.has_overflow_serial(oa, params))
    params[1].grad = torch.tensor([1.0, float("inf"), 0.0])
    assert bool(oa.has_overflow_serial(params)) and bool(cls.has_overflow_serial(oa, params))

    for a, b in zip(ea.parameters(), eb.parameters()):
        assert torch.equal(a, b)
    print("DEEPSPEED-OK")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_patches_real_deepspeed_zero_optimizer_on_cpu() -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "DEEPSPEED-OK" in result.stdout
