"""One rank of the DDP test: DistributedDataParallel(ORTModule(model)) against DDP(model), gloo."""

from __future__ import annotations

import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ortrain import ORTModule


def main(rank: int, world_size: int, port: str, out_path: str) -> None:
    # A rank that hangs fails on this timeout instead of stalling the suite.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        _train_and_compare(out_path)
        # Neither rank leaves (taking the store with it) while the other still needs it.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_and_compare(out_path: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    eager = DistributedDataParallel(copy.deepcopy(model))
    wrapped = DistributedDataParallel(ORTModule(model))
    opt_w = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    torch.manual_seed(100 + dist.get_rank())  # each rank its own data, so averaging matters
    for _ in range(3):
        x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
        for net, opt in ((wrapped, opt_w), (eager, opt_e)):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    assert wrapped.module._ortrain_graphs, "ORTModule never ran on ONNX Runtime"
    diff = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), eager.module.parameters(), strict=True)
    )
    with open(out_path, "w") as f:
        f.write(f"{diff}\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
