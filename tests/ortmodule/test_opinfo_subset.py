"""The OpInfo sweep (tools/opinfo_sweep.py) over the ~70 most common ops, as a regression test.

Ops are grouped so that a few captures cover all of them: each group is one module applying
every op of the group to its own learnable sample, trained one step under ORTModule with
FALLBACK_DISABLE and compared with eager PyTorch, outputs and gradients, op by op.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest (in the dev extra)")

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "opinfo_sweep.py"
_spec = importlib.util.spec_from_file_location("opinfo_sweep", _TOOL)
assert _spec is not None and _spec.loader is not None
sweep = importlib.util.module_from_spec(_spec)
sys.modules["opinfo_sweep"] = sweep  # dataclasses look their module up there
_spec.loader.exec_module(sweep)

GROUPS = 4


def test_common_ops_train_with_gradient_parity_entirely_in_onnxruntime() -> None:
    ops = {sweep.op_id(o): o for o in sweep.swept_ops()}
    cases = []
    for name in sweep.CI_OPS:
        found, reason = sweep.cases_for(ops[name], 1)
        assert found, f"{name}: {reason}"
        cases.append(found[0])
    failures = []
    for g in range(GROUPS):
        group = cases[g::GROUPS]
        results = sweep.check_grouped(group)
        if any(r.bucket != "onnxruntime" for r in results):
            # Run the group's ops alone so the failure names its op, not its neighbours.
            results = [r for case in group for r in sweep.check_grouped([case])]
        failures += [f"{r.op}: {r.bucket}: {r.error}" for r in results if r.bucket != "onnxruntime"]
    assert not failures, "\n".join(failures)
