"""Shape environments of freed captures are freed too (capture/shape_env_caches.py)."""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ortrain import ORTModule


def _live_shape_envs() -> int:
    gc.collect()
    return sum(isinstance(o, ShapeEnv) for o in gc.get_objects())


def test_evaluating_a_fresh_copy_every_few_steps_keeps_no_shape_environment_of_freed_copies() -> None:
    """``best = copy.deepcopy(model)`` evaluated and dropped, as a loop that keeps its best model
    does: each copy captures graphs of its own, and ShapeEnv's class-level memo caches kept every
    one of their shape environments (0.35 MiB each) for the rest of the process (wave 46's review)."""
    torch.manual_seed(0)
    model = ORTModule(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    counts = []
    for _ in range(4):
        best = copy.deepcopy(model).eval()
        with torch.no_grad():
            for rows in (4, 5, 6):  # a second size captures with open sizes: symbolic reasoning
                best(torch.randn(rows, 8))
        del best
        counts.append(_live_shape_envs())
    assert counts[-1] <= counts[0], counts
