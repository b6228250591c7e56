"""A real two-process torch.distributed (gloo) run of the load-balancing samplers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ortrain.utils.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

WORKER = Path(__file__).with_name("_sampler_dist_worker.py")
WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sampler_dist_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
def test_two_gloo_ranks_draw_the_plan_computed_without_distributed(tmp_path):
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    outputs = [tmp_path / f"rank{r}.json" for r in range(WORLD_SIZE)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(WORLD_SIZE), str(port), str(outputs[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD_SIZE)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log}"

    results = [json.loads(o.read_text()) for o in outputs]
    assert [(res["world_size"], res["rank"]) for res in results] == [(2, 0), (2, 1)]

    worker = load_worker_module()
    lengths = worker.dataset_lengths()
    n = len(lengths)
    # The plan every rank should have followed, computed here without any process group.
    reference = LoadBalancingDistributedSampler(lengths, lambda x: x, world_size=WORLD_SIZE, rank=0)
    for epoch in range(2):
        shards = [res["epochs"][epoch]["indices"] for res in results]
        assert len(shards[0]) == len(shards[1]) == (n + 1) // 2
        assert set(shards[0]) | set(shards[1]) == set(range(n))
        # Disjoint apart from the single padding sample that makes the odd dataset divide evenly.
        assert len(shards[0]) + len(shards[1]) - len(set(shards[0]) | set(shards[1])) == 1
        plan = reference.plan(epoch)
        for r in range(WORLD_SIZE):
            assert shards[r] == plan[:, r].tolist()

        batch_counts = [len(res["epochs"][epoch]["batches"]) for res in results]
        assert batch_counts[0] == batch_counts[1] == results[0]["epochs"][epoch]["steps"]
        for r in range(WORLD_SIZE):
            local = LoadBalancingDistributedBatchSampler(
                LoadBalancingDistributedSampler(lengths, lambda x: x, world_size=WORLD_SIZE, rank=r),
                worker.batch_fn,
            )
            local.set_epoch(epoch)
            assert results[r]["epochs"][epoch]["batches"] == list(local)
    assert results[0]["epochs"][0]["indices"] != results[0]["epochs"][1]["indices"]
