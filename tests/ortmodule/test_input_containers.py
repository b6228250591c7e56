"""A forward that changes the list or dict it is given changes the caller's, as in eager PyTorch
(ortrain/ortmodule/input_containers.py)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.ortmodule.input_containers import InputContainerChange, contents, refuse_changed_containers


class _WritesItsBatch(nn.Module):
    """Keeps its logits in the batch, collects features into a list it is given, and consumes a key."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, batch: dict[str, torch.Tensor], features: list[torch.Tensor]) -> torch.Tensor:
        logits = self.fc(batch["x"])
        batch["logits"] = logits
        features.append(logits.detach())
        weight = batch.pop("weight")
        return (nn.functional.cross_entropy(logits, batch["y"], reduction="none") * weight).mean()


def test_the_callers_batch_and_list_get_the_forwards_changes(caplog: pytest.LogCaptureFixture) -> None:
    """Wave 29: the capture made the changes to containers rebuilt from the call's tensors, and the
    caller's batch never got its logits nor lost its weight."""
    torch.manual_seed(0)
    eager = _WritesItsBatch()
    wrapped = ORTModule(copy.deepcopy(eager))
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step in range(3):
            x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
            calls = []
            for module in (eager, wrapped):
                batch, features = {"x": x, "y": y, "weight": torch.rand(5)}, [x]
                torch.manual_seed(step)
                batch["weight"] = torch.rand(5)
                loss = module(batch, features)
                loss.backward()
                calls.append((loss, batch, features))
            (loss_e, batch_e, feats_e), (loss_w, batch_w, feats_w) = calls
            torch.testing.assert_close(loss_w, loss_e)
            assert sorted(batch_w) == sorted(batch_e) == ["logits", "x", "y"]
            torch.testing.assert_close(batch_w["logits"], batch_e["logits"])
            assert len(feats_w) == len(feats_e) == 2
    for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert "changes a list, dict, dataclass or object it was given" in caplog.text
    assert not wrapped._ortrain_fallback.active


def test_unchanged_containers_pass_and_changes_are_refused() -> None:
    x = torch.ones(2)
    batch = {"x": x, "parts": [x, (x, 1)]}
    before = contents(batch)
    refuse_changed_containers(before, contents(batch))
    batch["x"].add_(1)  # a write into a tensor is the graph's, not a container change
    refuse_changed_containers(before, contents(batch))
    batch["parts"][0] = x.clone()
    with pytest.raises(InputContainerChange, match="changes a list, dict, dataclass or object it was given"):
        refuse_changed_containers(before, contents(batch))


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    logits: torch.Tensor | None = None


class _SetsItsLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, batch: _Batch) -> torch.Tensor:
        batch.logits = self.fc(batch.x)
        return batch.logits.square().mean()


def test_a_field_set_on_a_dataclass_batch_reaches_the_callers() -> None:
    wrapped = ORTModule(_SetsItsLogits())
    for _ in range(2):
        batch = _Batch(torch.randn(5, 4))
        wrapped(batch).backward()
        assert batch.logits is not None
        torch.testing.assert_close(batch.logits, wrapped.module.fc(batch.x))
