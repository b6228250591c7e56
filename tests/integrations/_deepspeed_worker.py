"""One rank of the guidelines §5 recipe: ORTModule + FusedAdam + deepspeed.initialize + FP16_Optimizer.

Runs the recipe and the same recipe without ORTModule side by side for a ZeRO stage and a dtype,
several steps on rank-specific data (so ZeRO's gradient reduction matters), and writes the largest
parameter difference, or the error, as JSON.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Iterator
from traceback import format_exc
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
POLICY_VARIABLE = "ORTMODULE_FALLBACK_POLICY"


def _engine(model: nn.Module, stage: int, dtype: str) -> tuple[Any, Any]:
    import deepspeed

    from ortrain.optim import FusedAdam
    from ortrain.optim.fp16_optimizer import FP16_Optimizer

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        # Threshold 0: ZeRO-3 partitions every parameter, however small (the default keeps
        # parameters under 100k elements whole on every rank).
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,  # FusedAdam is not on DeepSpeed's list
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    return engine, FP16_Optimizer(optimizer)


def _full_parameters(engine: Any, stage: int) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().clone() for p in params]
    return [p.detach().float().clone() for p in params]


@contextlib.contextmanager
def _fallback_policy(policy: str) -> Iterator[None]:
    """``default``: build the ORTModule under the default policy, whatever the launcher set."""
    saved = os.environ.get(POLICY_VARIABLE)
    if policy == "default":
        os.environ.pop(POLICY_VARIABLE, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[POLICY_VARIABLE] = saved


def _executor_counts(wrapped: Any) -> dict[str, int]:
    """Compute nodes per executor over every captured graph (per-operator fallback shows here)."""
    counts: dict[str, int] = {}
    for entries in wrapped._ortrain_graphs.values():
        for entry in entries:
            for slot in (entry.capture.forward, entry.capture.backward):
                if slot is not None:
                    for name, n in slot.runner.plan.nodes_by_executor().items():
                        counts[name] = counts.get(name, 0) + n
    return counts


def run(stage: int, dtype: str, policy: str, steps: int = 4) -> dict[str, Any]:
    from ortrain import ORTModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    eager_engine, _ = _engine(copy.deepcopy(model), stage, dtype)
    with _fallback_policy(policy):
        wrapped_model = ORTModule(model)
    ort_engine, ort_opt = _engine(wrapped_model, stage, dtype)
    assert type(ort_opt).__name__.startswith("DeepSpeedZeroOptimizer"), type(ort_opt)
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)
    losses: dict[str, list[float]] = {"ortrain": [], "eager": []}
    input_dtype = DTYPES[dtype] or torch.float32
    for _ in range(steps):
        x = torch.randn(4, 8, generator=generator).to(input_dtype)
        y = torch.randn(4, 4, generator=generator)
        for name, engine in (("ortrain", ort_engine), ("eager", eager_engine)):
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())
    wrapped = ort_engine.module
    ran_on_ort = isinstance(wrapped, ORTModule) and bool(wrapped._ortrain_graphs)
    ran_on_ort = ran_on_ort and not wrapped._ortrain_fallback.active
    pairs = zip(_full_parameters(ort_engine, stage), _full_parameters(eager_engine, stage), strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    return {
        "diff": diff,
        "losses": losses,
        "ran_on_ort": ran_on_ort,
        "optimizer": type(ort_opt).__name__,
        "executors": _executor_counts(wrapped) if ran_on_ort else {},
        # FP16_Optimizer binds its multi-tensor overflow check on the ZeRO 1/2 optimizer instance.
        "fp16_optimizer_patched": "has_overflow_serial" in vars(ort_opt),
    }


def main(cases: str, out_path: str) -> None:
    """``cases``: comma-separated ``stage:dtype:policy`` (``2:fp32:disable,2:bf16:default``), policy
    ``disable`` keeping the launcher's ORTMODULE_FALLBACK_POLICY; one process group for all."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results: dict[str, Any] = {}
    for case in cases.split(","):
        stage, dtype, policy = case.split(":")
        try:
            results[case] = run(int(stage), dtype, policy)
        except Exception as error:
            message = f"{type(error).__name__}: {error}"[:2000]
            results[case] = {"error": message, "trace": format_exc()[-3000:]}
        torch.distributed.barrier()
    with open(out_path, "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(sys.argv[1], sys.argv[2])
