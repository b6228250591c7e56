"""The parity zoo's models again, through ``torch.compile(model, backend="ortrain")``."""

from __future__ import annotations

import pytest
import test_parity_zoo as zoo
from _compile_parity import count_dynamo_graphs, train_compiled_side_by_side


def _train_compiled(model, batches, loss_fn):
    expected = count_dynamo_graphs(model, batches, loss_fn)
    losses_ort, losses_eager, eager, backend = train_compiled_side_by_side(model, batches, loss_fn)
    # Dynamo's own split (graph breaks in library code, recompilations for new lengths) decides
    # the number of graphs here, not the zoo's bound for ORTModule: ortrain must add none.
    assert backend.graphs_compiled == expected
    return losses_ort, losses_eager, eager, model  # the model trained in place, under its own names


def _one_capture_per_graph(model) -> int:
    return 1  # checked against Dynamo's own count above


@pytest.fixture(autouse=True)
def _through_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # The zoo's own checks of losses and parameters stay as written; graphs are counted above.
    monkeypatch.setattr(zoo, "train_side_by_side", _train_compiled)
    monkeypatch.setattr(zoo, "ort_graph_count", _one_capture_per_graph)


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
