"""The export cache key: one thing changed at a time must miss; new weights must hit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import ortrain
from ortrain.cache import graph_key
from ortrain.cache.graph_key import export_key
from ortrain.capture.aot_capture import capture


class _Net(nn.Module):
    def __init__(self, width: int = 8, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), act(), nn.Linear(width, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.body(x).square().mean(),)


def _keys(net: nn.Module, x: torch.Tensor, *, training: bool = True, opset: int = 18) -> tuple[str, ...]:
    torch.manual_seed(0)
    captured = capture(net, [x], training=training)
    graphs = [captured.forward] + ([captured.backward] if captured.backward is not None else [])
    return tuple(export_key(g.graph, opset_version=opset) for g in graphs)


@pytest.fixture(scope="module")
def reference() -> tuple[str, ...]:
    torch.manual_seed(0)
    return _keys(_Net(), torch.randn(3, 4))


def test_same_model_with_other_weights_hits(reference: tuple[str, ...]) -> None:
    torch.manual_seed(123)  # other weights: they are graph inputs, not part of the graph
    assert _keys(_Net(), torch.randn(3, 4)) == reference


@pytest.mark.parametrize(
    "change",
    ["code", "config", "dtype", "input shape", "requires grad", "eval mode", "opset"],
)
def test_each_change_misses(reference: tuple[str, ...], change: str) -> None:
    net, x, training, opset = _Net(), torch.randn(3, 4), True, 18
    if change == "code":
        net = _Net(act=nn.GELU)
    elif change == "config":
        net = _Net(width=16)
    elif change == "dtype":
        net, x = net.double(), x.double()
    elif change == "input shape":
        x = torch.randn(5, 4)
    elif change == "requires grad":
        net.body[0].requires_grad_(False)
    elif change == "eval mode":
        training = False
    elif change == "opset":
        opset = 19
    keys = _keys(net, x, training=training, opset=opset)
    assert keys[0] != reference[0]
    assert not set(keys) & set(reference)


def test_versions_and_export_code_are_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    captured = capture(_Net(), [torch.randn(3, 4)], training=False)
    before = export_key(captured.forward.graph, opset_version=18)
    assert set(graph_key.versions()) == {"python", "ortrain", "torch", "onnx", "onnxscript", "onnxruntime"}
    for package in ("torch", "onnx", "onnxscript", "onnxruntime", "ortrain"):
        changed = {**graph_key.versions(), package: "0.0.0"}
        monkeypatch.setattr(graph_key, "versions", lambda changed=changed: changed)
        assert export_key(captured.forward.graph, opset_version=18) != before, package
        monkeypatch.undo()
    monkeypatch.setattr(graph_key, "export_code_hash", lambda: "another exporter")
    assert export_key(captured.forward.graph, opset_version=18) != before


def test_graph_constants_are_hashed_by_value() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("_tensor_constant0")
    graph.output((graph.call_function(torch.add, (x, c)),))
    root = nn.Module()
    root.register_buffer("_tensor_constant0", torch.zeros(3))
    first = export_key(torch.fx.GraphModule(root, graph), opset_version=18)
    root._tensor_constant0 = torch.ones(3)
    assert export_key(torch.fx.GraphModule(root, graph), opset_version=18) != first


def test_a_zero_dim_constant_is_hashed() -> None:
    """``x[:, 0] = 0`` and ``* torch.tensor(2.0)`` put 0-d constants in the graph: viewing one as
    bytes raised, which crashed op tuning's first race ("self.dim() cannot be 0")."""
    assert graph_key.tensor_digest(torch.tensor(2.0)) != graph_key.tensor_digest(torch.tensor(3.0))
    assert graph_key.tensor_digest(torch.tensor(2.0)) == graph_key.tensor_digest(torch.tensor([2.0]))


@pytest.mark.parametrize(
    "edited",
    [
        "export/nan_propagation.py",
        "export/integer_sums.py",
        "capture/decompositions.py",
        "passes/erf_gelu.py",
    ],
)
def test_every_module_the_export_runs_is_in_its_code_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edited: str
) -> None:
    """Until wave 54 the hash read 18 named files: an entry exported before the NaN fix in
    export/nan_propagation.py was read by the fixed exporter, and its output differed from eager's."""
    copy = tmp_path / "ortrain"
    shutil.copytree(Path(ortrain.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(ortrain, "__file__", str(copy / "__init__.py"))
    try:
        graph_key.export_code_hash.cache_clear()
        before = graph_key.export_code_hash()
        with (copy / edited).open("a") as file:
            file.write("\n# a fix\n")
        graph_key.export_code_hash.cache_clear()
        assert graph_key.export_code_hash() != before
    finally:
        graph_key.export_code_hash.cache_clear()
