"""Data-parallel wrappers inside the ORTModule and FSDP2 (``fully_shard``): refused by name, or
trained in PyTorch after one warning.

Wave 28: ``ORTModule(DistributedDataParallel(model))`` trained each rank on its own gradients,
silently (the graph skips DDP's forward); ``fully_shard(ORTModule(model))`` turned the wrapped model
(not the wrapper) into an FSDP module and failed in FSDP with "no attribute '_ortrain_module'", and
``ORTModule(fully_shard(model))`` failed its capture with "Please convert all Tensors to
FakeTensors": none said what to do.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ortrain import ORTModule
from ortrain.errors import ORTModuleTorchModelException

fsdp = pytest.importorskip("torch.distributed.fsdp")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.second(torch.relu(self.first(x))), y)


def _sharded(model: nn.Module) -> nn.Module:
    fsdp.fully_shard(model.first)
    fsdp.fully_shard(model)
    return model


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one rank (gloo, a file store): FSDP's collectives are local copies."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_wrapping_distributed_data_parallel_is_refused_by_name(one_rank) -> None:
    with pytest.raises(TypeError, match=r"DistributedDataParallel\(ORTModule\(model\)\)"):
        ORTModule(DistributedDataParallel(_Net()))


class _HoldsDataParallel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = DistributedDataParallel(_Net())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.body(x, y)


def test_a_data_parallel_submodule_trains_in_pytorch(one_rank, monkeypatch, caplog) -> None:
    wrapped = ORTModule(_HoldsDataParallel())
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with pytest.raises(ORTModuleTorchModelException, match="submodule 'body' is a DistributedDataParallel"):
        wrapped(x, y)
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    wrapped = ORTModule(_HoldsDataParallel())
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        loss = wrapped(x, y)
    loss.backward()
    torch.testing.assert_close(loss, wrapped.module(x, y), rtol=0, atol=0)
    assert "'body' is a DistributedDataParallel" in caplog.text


def test_sharding_the_wrapper_is_refused_by_name(one_rank) -> None:
    wrapped = ORTModule(_Net())
    with pytest.raises(TypeError, match=r"FSDP.*DistributedDataParallel"):
        fsdp.fully_shard(wrapped)
    assert type(wrapped.module) is _Net


def test_a_sharded_model_is_refused_under_fallback_disable(one_rank) -> None:
    wrapped = ORTModule(_sharded(_Net()))
    with pytest.raises(ORTModuleTorchModelException, match=r"'first\.weight' is a DTensor"):
        wrapped(torch.randn(4, 8), torch.randint(0, 4, (4,)))


def test_a_sharded_model_trains_in_pytorch_after_one_warning(one_rank, monkeypatch, caplog) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    base = _Net()
    eager = _sharded(copy.deepcopy(base))
    wrapped = ORTModule(_sharded(copy.deepcopy(base)))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(3):
            losses = []
            for model, optimizer in zip((eager, wrapped), optimizers, strict=True):
                loss = model(x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            assert losses[0] == losses[1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "DTensor" in warnings[0]
    for a, b in zip(eager.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0)


def test_a_new_class_for_the_wrapper_stays_on_the_wrapper() -> None:
    """Composable wrappers give the wrapper a subclass of its class; it reached the model."""
    model = _Net()
    wrapped = ORTModule(model)
    wrapped.__class__ = type("Traced", (type(wrapped),), {})
    assert type(model) is _Net and type(wrapped).__name__ == "Traced"
    loss = wrapped(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    loss.backward()
    assert model.first.weight.grad is not None
