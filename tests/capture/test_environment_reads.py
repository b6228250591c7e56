"""A forward that reads an environment variable trains through the graph-break path, which reads it
at every step: a captured graph held the branch of its first value (wave 49's review)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from ortrain import ORTModule


class _HeadFromEnvironment(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = self.b if os.environ.get("ORTRAIN_TEST_HEAD", "a") == "b" else self.a
        return head(x).square().mean()


def test_an_environment_variable_flipped_between_steps_is_read_at_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    eager = _HeadFromEnvironment()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    for head in ("a", "b", "a", "b"):
        monkeypatch.setenv("ORTRAIN_TEST_HEAD", head)
        expected, got = eager(x), wrapped(x)
        torch.testing.assert_close(got, expected, msg=f"head {head}")
    assert wrapped._ortrain_graph_breaks is not None


def test_pytorchs_own_reads_while_tracing_leave_the_model_whole() -> None:
    # The first version took Python's frozen `os` module (`<frozen os>`, os.getenv) for the
    # model's code: PyTorch's own read of MAST_HPC_JOB_NAME while tracing sent every model to the
    # graph-break path.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    wrapped = ORTModule(model)
    wrapped(torch.randn(3, 4)).sum().backward()
    assert wrapped._ortrain_graph_breaks is None and len(wrapped._ortrain_graphs) == 1
