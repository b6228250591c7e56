"""The Triton multi-tensor Adam kernel (FusedAdam's CUDA path), run on the CPU by Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is imported, so the check runs in a subprocess. It drives
the kernel exactly as FusedAdam does on CUDA (same launcher, pointer and chunk tables), on CPU tensors.
What it cannot cover: compiled-GPU behaviour and speed, which need an NVIDIA GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed (pip install 'ortrain[triton]')"
)

SCRIPT = textwrap.dedent(
    """
    import torch
    from optim_reference import adam_formula_step
    from ortrain.optim import _multi_tensor_adam_triton as k
    from ortrain.optim.fused_adam import AdamWMode, _Hyper

    assert k.HAS_TRITON
    shapes = [(7,), (0,), (13, 5), (2 * k.BLOCK + 3,), (1,)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mode in AdamWMode:
            for bias_correction in (True, False):
                gen = torch.Generator().manual_seed(0)
                params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
                ms = [torch.zeros(s) for s in shapes]
                vs = [torch.zeros(s) for s in shapes]
                ref = [p.double() for p in params]
                rms = [m.double() for m in ms]
                rvs = [v.double() for v in vs]
                for step in (1, 2, 3):
                    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
                    h = _Hyper(lr=hyper["lr"], beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1, step=step,
                               bias_correction=bias_correction, mode=mode)
                    k.multi_tensor_adam(params, grads, ms, vs, h)
                    for i, g in enumerate(grads):
                        new_p, rms[i], rvs[i] = adam_formula_step(
                            ref[i], g, rms[i], rvs[i], step, mode=int(mode),
                            bias_correction=bias_correction, **hyper)
                        # the reference parameter is stored in `dtype` too
                        ref[i] = new_p.to(dtype).double()
                for i in range(len(shapes)):
                    torch.testing.assert_close(ms[i].double(), rms[i], atol=1e-6, rtol=1e-6)
                    torch.testing.assert_close(vs[i].double(), rvs[i], atol=1e-6, rtol=1e-6)
                    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
                    torch.testing.assert_close(params[i].double(), ref[i], atol=1e-6, rtol=ulp)
    print("TRITON-ADAM-OK")
    """
)


def test_triton_kernel_matches_formula_in_interpreter() -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(repo), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TRITON-ADAM-OK" in result.stdout
