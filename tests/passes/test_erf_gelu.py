"""fuse_erf_gelu: the exact GELU's five-node chain becomes one com.microsoft.Gelu, same values."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ortrain import ORTModule
from ortrain.ortmodule import DebugOptions
from ortrain.passes.erf_gelu import fuse_erf_gelu
from ortrain.passes.pipeline import default_passes

SHAPE = [4, 16, 64]


def _model(
    *, order: str = "exported", sqrt2: float = math.sqrt(2.0), erf_read_elsewhere: bool = False
) -> onnx.ModelProto:
    """``y = gelu(x)`` as the exporter writes it (``order="exported"``) or with the operands of
    the Add and both Muls swapped (``"swapped"``)."""
    if order == "exported":
        add = helper.make_node("Add", ["e", "one"], ["a"])
        halve = helper.make_node("Mul", ["half", "a"], ["m"])
        scale = helper.make_node("Mul", ["x", "m"], ["y"])
    else:
        add = helper.make_node("Add", ["one", "e"], ["a"])
        halve = helper.make_node("Mul", ["a", "half"], ["m"])
        scale = helper.make_node("Mul", ["m", "x"], ["y"])
    divide, erf = helper.make_node("Div", ["x", "s"], ["d"]), helper.make_node("Erf", ["d"], ["e"])
    nodes = [divide, erf, add, halve, scale]
    constants = [
        numpy_helper.from_array(np.array(sqrt2, dtype=np.float32), "s"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)]
    if erf_read_elsewhere:  # as a backward graph that reads erf(x / sqrt 2) would
        outputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, SHAPE))
    graph = helper.make_graph(
        nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)], outputs, constants
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize("order", ["exported", "swapped"])
def test_the_chain_becomes_one_gelu_with_the_same_values(order: str) -> None:
    model = _model(order=order)
    fused = fuse_erf_gelu(model)
    assert [(n.domain, n.op_type) for n in fused.graph.node] == [("com.microsoft", "Gelu")]
    assert not fused.graph.initializer  # the chain's constants went with it
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32) * 3
    (expected,) = _run(model, x)
    (got,) = _run(fused, x)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(got), torch.nn.functional.gelu(torch.from_numpy(x)))


def test_a_chain_whose_erf_is_read_elsewhere_is_kept() -> None:
    model = _model(erf_read_elsewhere=True)
    assert [n.op_type for n in fuse_erf_gelu(model).graph.node] == ["Div", "Erf", "Add", "Mul", "Mul"]


def test_another_constant_is_not_gelu() -> None:
    model = _model(sqrt2=1.5)
    assert [n.op_type for n in fuse_erf_gelu(model).graph.node] == ["Div", "Erf", "Add", "Mul", "Mul"]


def test_in_the_default_pipeline() -> None:
    assert "fuse_erf_gelu" in [name for name, _ in default_passes(compute_optimizer=True)]


def test_a_gelu_mlp_trains_like_eager_with_the_fused_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="gelu"))
    x, target = torch.randn(16, 32), torch.randn(16, 8)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    for _ in range(3):
        for module, optimizer in zip((eager, wrapped), optimizers, strict=True):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(module(x), target).backward()
            optimizer.step()
        for a, b in zip(eager.parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    forward = onnx.load(tmp_path / "gelu_forward_optimized_training.onnx")
    assert ("com.microsoft", "Gelu") in {(n.domain, n.op_type) for n in forward.graph.node}
