"""mark_distinct_indices + copy_into_distinct_positions: additions at nonzero()'s positions are copies."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain import ORTModule
from ortrain.capture.distinct_index_scatters import copy_into_distinct_positions, mark_distinct_indices
from ortrain.ortmodule import DebugOptions

aten = torch.ops.aten
MASK = torch.tensor([True, False, True, True, False, False, True, False])


def _rows_at_real_positions(mask: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    index = torch.nonzero(mask).view(-1)  # padding elimination's real-token positions
    return torch.zeros(mask.numel(), src.shape[1]).index_add(0, index, src)


def _put_at_real_positions(mask: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    index = torch.nonzero(mask).squeeze(1)
    return torch.zeros(mask.numel(), src.shape[1]).index_put((index,), src, accumulate=True)


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and "index" in str(n.target)]


def _into_a_tensor_that_holds_values(mask: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    index = torch.nonzero(mask).view(-1)
    return torch.linspace(0, 1, mask.numel() * 3).view(-1, 3).index_add(0, index, src)  # adds onto them


@pytest.mark.parametrize(
    ("fn", "before", "after"),
    [
        (_rows_at_real_positions, aten.index_add.default, aten.index_copy.default),
        (_put_at_real_positions, aten.index_put.default, aten.index_put.default),
        (_into_a_tensor_that_holds_values, aten.index_add.default, aten.index_copy.default),
    ],
)
def test_a_scatter_at_nonzero_positions_copies_with_the_same_values(
    fn: Callable[..., torch.Tensor], before: object, after: object
) -> None:
    src = torch.randn(int(MASK.sum()), 3)
    gm = make_fx(fn)(MASK, src)
    assert before in _targets(gm)
    assert mark_distinct_indices(gm.graph) == 1
    assert copy_into_distinct_positions(gm) == 1
    assert after in _targets(gm) and aten.index_add.default not in _targets(gm)
    (scatter,) = [n for n in gm.graph.nodes if n.target is after]
    assert scatter.target is aten.index_copy.default or scatter.args[3] is False
    torch.testing.assert_close(gm(MASK, src), fn(MASK, src), rtol=0, atol=0)


def _positions_of_a_matrix(mask: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    index = torch.nonzero(mask.view(2, 4)).reshape(-1)  # (row, column) pairs flattened: values repeat
    return torch.zeros(8, src.shape[1]).index_add(0, index, src.repeat(2, 1))


def _indices_from_the_caller(mask: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    labels = mask.long() * 3  # any index tensor may repeat
    return torch.zeros(8, src.shape[1]).index_add(0, labels[: src.shape[0]], src)


@pytest.mark.parametrize("fn", [_positions_of_a_matrix, _indices_from_the_caller])
def test_other_accumulations_keep_adding(fn: Callable[..., torch.Tensor]) -> None:
    gm = make_fx(fn)(MASK, torch.randn(int(MASK.sum()), 3))
    assert mark_distinct_indices(gm.graph) == 0
    assert copy_into_distinct_positions(gm) == 0
    assert aten.index_add.default in _targets(gm)


class _PaddedTagger(nn.Module):
    """Token-wise layers over an embedding with a padding index, a loss that ignores pads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.layers(self.embed(ids)))
        return nn.functional.cross_entropy(logits.view(-1, 5), labels.view(-1), ignore_index=-100)


def test_padding_elimination_gathers_without_serial_scatters_and_matches_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "1")
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    torch.manual_seed(0)
    eager = _PaddedTagger()
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="tagger"))
    for lengths in ([5, 9, 2, 12], [12, 1, 7, 3]):
        ids = torch.randint(1, 50, (4, 12))
        for row, length in enumerate(lengths):
            ids[row, length:] = 0
        labels = torch.where(ids == 0, -100, torch.randint(0, 5, (4, 12)))
        for module in (eager, wrapped):
            module.zero_grad()
            module(ids, labels).backward()
        for (name, a), b in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    backward = onnx.load(tmp_path / "tagger_backward_optimized_training.onnx")
    # The embedding's own gradient adds repeated ids one by one (ScatterElements into [50, 16]);
    # the gathers of the real tokens' rows scatter their gradient back with a plain ScatterND.
    serial = [n for n in backward.graph.node if n.op_type == "ScatterElements"]
    assert len(serial) == 1
    assert any(n.op_type == "ScatterND" for n in backward.graph.node)
