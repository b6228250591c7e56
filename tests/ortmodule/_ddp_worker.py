"""One rank of the DDP test: DistributedDataParallel(ORTModule(model)) against DDP(model), gloo."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ortrain import ORTModule


def main(rank: int, world_size: int, port: str, out_path: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    eager = DistributedDataParallel(copy.deepcopy(model))
    wrapped = DistributedDataParallel(ORTModule(model))
    opt_w = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank its own data, so averaging matters
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
