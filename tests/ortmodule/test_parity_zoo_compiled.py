"""The parity zoo's models again, through ``torch.compile(model, backend="ortrain")``."""

from __future__ import annotations

import pytest
import test_parity_zoo as zoo
from _compile_parity import train_compiled_side_by_side

_backends: dict[int, object] = {}


def _train_compiled(model, batches, loss_fn):
    losses_ort, losses_eager, eager, backend = train_compiled_side_by_side(model, batches, loss_fn)
    _backends[id(model)] = backend
    return losses_ort, losses_eager, eager, model  # the model trained in place, under its own names


def _graphs(model) -> int:
    return _backends.pop(id(model)).graphs_compiled


@pytest.fixture(autouse=True)
def _through_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # The zoo's own checks (losses, parameters after every step, number of graphs) stay as written.
    monkeypatch.setattr(zoo, "train_side_by_side", _train_compiled)
    monkeypatch.setattr(zoo, "ort_graph_count", _graphs)


@pytest.mark.parametrize(
    "case",
    [
        "test_mlp",
        "test_cnn_with_batchnorm_pooling_and_grouped_strided_conv",
        "test_tiny_gpt_with_ignore_index_and_changing_lengths",
        "test_hf_gpt2_lm_head",
    ],
)
def test_zoo_model_under_torch_compile(case: str) -> None:
    test = getattr(zoo, case)
    if case == "test_tiny_gpt_with_ignore_index_and_changing_lengths":
        test("sdpa")
    else:
        test()
