"""Objects of the user's own classes as inputs and outputs (``model(batch)``, wave 32).

Until wave 32 an input such as ``class Batch`` sent the model to PyTorch for good ("ORTModule
cannot pass input 'batch' (a Batch)"); it is now passed by its attributes, as a dataclass is.
"""

from __future__ import annotations

import argparse
import logging
import types

import pytest
import torch
import torch.nn.functional as F
from _parity import ort_graph_count, train_side_by_side
from torch import nn

from ortrain import ORTModule


class _Batch:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
        self.x = x
        self.y = y
        self.scale = scale
        self.meta = {"rows": x.shape[0]}

    def inputs(self) -> torch.Tensor:  # a method the forward calls: the class is kept
        return self.x * self.scale


class _Result:
    def __init__(self, loss: torch.Tensor, logits: torch.Tensor) -> None:
        self.loss = loss
        self.logits = logits


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, batch: _Batch) -> _Result:
        logits = self.fc(batch.inputs())
        return _Result(F.cross_entropy(logits, batch.y) * batch.meta["rows"] / 4, logits)


def _batch(step: int, scale: float = 1.0) -> _Batch:
    g = torch.Generator().manual_seed(step)
    return _Batch(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g), scale)


def test_a_batch_object_in_and_a_result_object_out_train_on_onnxruntime() -> None:
    torch.manual_seed(0)
    batches = [_batch(step) for step in range(4)]
    losses_ort, losses_eager, _, wrapped = train_side_by_side(_Classifier(), batches, lambda m, b: m(b).loss)
    assert losses_ort == pytest.approx(losses_eager, rel=1e-5)
    assert ort_graph_count(wrapped) == 1  # one graph for all four batches
    result = wrapped(batches[0])
    assert type(result) is _Result and result.logits.shape == (4, 3)


def test_a_changed_attribute_of_the_batch_is_seen(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = _Classifier()
    wrapped = ORTModule(model)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for step, scale in enumerate((1.0, 1.0, 2.0)):
            batch = _batch(step, scale)
            assert wrapped(batch).loss.item() == pytest.approx(model(batch).loss.item(), rel=1e-6)
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing a graph:")]
    assert (
        reasons[1]
        == "capturing a graph: input 0.scale changed from 1.0; it is an input of the graph from now on"
    )


class _Annotating(_Classifier):
    def forward(self, batch: _Batch) -> _Result:  # type: ignore[override]
        logits = self.fc(batch.x)
        batch.logits = logits  # the caller reads it afterwards
        return _Result(F.cross_entropy(logits, batch.y), logits)


def test_an_attribute_the_forward_sets_on_the_batch_reaches_the_caller() -> None:
    torch.manual_seed(0)
    wrapped = ORTModule(_Annotating())
    for step in range(3):
        batch = _batch(step)
        loss = wrapped(batch).loss
        loss.backward()
        torch.testing.assert_close(batch.logits, wrapped.module.fc(batch.x))


class _NamespaceClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, batch: types.SimpleNamespace) -> torch.Tensor:
        return F.cross_entropy(self.fc(batch.x) * batch.scale, batch.y)


@pytest.mark.parametrize("kind", [types.SimpleNamespace, argparse.Namespace])
def test_a_namespace_batch_trains_on_onnxruntime(kind: type) -> None:
    torch.manual_seed(0)
    batches = [kind(x=b.x, y=b.y, scale=b.scale) for b in (_batch(step) for step in range(3))]
    model = _NamespaceClassifier()
    losses_ort, losses_eager, _, wrapped = train_side_by_side(model, batches, lambda m, b: m(b))
    assert losses_ort == pytest.approx(losses_eager, rel=1e-5)
    assert ort_graph_count(wrapped) == 1
