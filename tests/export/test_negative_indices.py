"""Indices PyTorch refuses when negative are refused by the exported graph too."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.export.negative_indices import refuse_negative_indices

aten = torch.ops.aten


def _traced(fn, *args: torch.Tensor) -> torch.fx.GraphModule:  # type: ignore[no-untyped-def]
    return make_fx(fn, tracing_mode="fake")(*args)


def _fills(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is aten.masked_fill.Scalar]


def test_an_input_index_is_guarded_once_for_all_its_users() -> None:
    def f(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = weight.index_select(0, ids.flatten()).view(2, 3, 4)
        return torch.nn.functional.embedding(ids, weight) + rows

    gm = _traced(f, torch.randn(10, 4), torch.randint(0, 10, (2, 3)))
    assert refuse_negative_indices(gm) == 2  # ids, and its flattened view (a new node)
    weight, ids = torch.randn(10, 4), torch.randint(0, 10, (2, 3))
    torch.testing.assert_close(gm(weight, ids), f(weight, ids))  # valid indices: same values
    for fill in _fills(gm):
        assert fill.args[2] == torch.iinfo(torch.int64).min
        assert fill.meta["val"].dtype == torch.int64


def test_indices_that_cannot_be_negative_are_left_alone() -> None:
    def f(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(labels != -100).view(-1)
        top = x.topk(2, dim=1).indices
        columns = x.index_select(1, torch.arange(3))
        return x.index_select(0, rows).sum() + x.gather(1, top).sum() + columns.sum()

    gm = _traced(f, torch.randn(5, 4), torch.tensor([1, -100, 2, -100, 0]))
    assert refuse_negative_indices(gm) == 0
    assert not _fills(gm)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "torch.onnx.export"])
def test_a_negative_label_fails_in_onnx_runtime_instead_of_wrapping(
    direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime as ort

    from ortrain.export import fx_to_onnx

    monkeypatch.setattr(fx_to_onnx, "DIRECT_TRANSLATION", direct)

    def f(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor]:
        return (logits.gather(1, target.unsqueeze(1)),)  # the graphs ortrain exports return tuples

    gm = make_fx(f)(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    exported = fx_to_onnx.export_graph(gm, opset_version=18)
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    logits = torch.randn(3, 5).numpy()
    (fine,) = session.run(None, dict(zip(names, (logits, torch.tensor([0, 4, 2]).numpy()), strict=True)))
    assert fine.shape == (3, 1)
    try:
        session.run(None, dict(zip(names, (logits, torch.tensor([0, -1, 2]).numpy()), strict=True)))
    except Exception as error:  # onnxruntime's own exception types
        assert "Out of range value in index tensor" in str(error)
    else:
        raise AssertionError("ONNX Runtime read index -1 from the end")


def test_getitem_of_other_outputs_is_not_taken_for_indices() -> None:
    def f(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        values = x.max(dim=1)[0].long()  # values, not indices: may be negative
        return x.index_select(0, values.clamp(max=4)) + ids.sum()

    gm = _traced(f, torch.randn(5, 4), torch.tensor([1]))
    assert [n.target for n in gm.graph.nodes if n.target is operator.getitem]
    assert refuse_negative_indices(gm) == 1


class _Segmenter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Conv2d(3, 4, 1)

    def forward(self, image: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(image), labels, ignore_index=255)


def test_a_negative_segmentation_label_raises_eagers_error_and_ignored_ones_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Wave 49's review: nll_loss2d stays whole in the graph, and its -1 label read the last class.
    from ortrain import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _Segmenter()
    wrapped = ORTModule(copy.deepcopy(eager))
    image = torch.randn(2, 3, 4, 4)
    labels = torch.randint(0, 4, (2, 4, 4))
    labels[0, 0, :2] = 255
    for model in (eager, wrapped):
        model(image, labels).backward()
    torch.testing.assert_close(wrapped.head.weight.grad, eager.head.weight.grad)
    labels[1, 2, 3] = -1
    for model in (eager, wrapped):
        with pytest.raises(IndexError, match="Target -1 is out of bounds"), torch.no_grad():
            model(image, labels)
