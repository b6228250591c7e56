"""select_by_bit_mask: floating-point Where as integer products of the bits, bit for bit the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from _eager_parity import one_step_against_eager
from onnx import TensorProto, helper, numpy_helper

from ortrain.passes.bitwise_where import BITCAST_OPSET, runtime_has_bitcast, select_by_bit_mask
from ortrain.passes.pipeline import default_passes

pytestmark = pytest.mark.skipif(
    not runtime_has_bitcast(), reason="this ONNX Runtime has no BitCast (opset 26)"
)

_SHAPE = [4, 8, 32, 32]
_SPECIAL = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-45, -3.5], dtype=np.float32)


def _where_model(
    then: np.ndarray | None,
    other: np.ndarray | None,
    *,
    condition_shape: list[int],
    dtype: int,
    extra: tuple[onnx.NodeProto, ...] = (),
) -> onnx.ModelProto:
    """Where(c, x or a constant, y or a constant); the computed branches are graph inputs."""
    inputs = [helper.make_tensor_value_info("c", TensorProto.BOOL, condition_shape)]
    initializers = []
    for name, constant in (("x", then), ("y", other)):
        if constant is None:
            inputs.append(helper.make_tensor_value_info(name, dtype, _SHAPE))
        else:
            initializers.append(numpy_helper.from_array(constant, name))
    graph = helper.make_graph(
        [helper.make_node("Where", ["c", "x", "y"], ["out"]), *extra],
        "where",
        inputs,
        [helper.make_tensor_value_info("out", dtype, _SHAPE)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in wanted})[0]


def _feeds(condition_shape: list[int], dtype: np.dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(_SHAPE).astype(dtype) for _ in range(2))
    # Every special value on both branches, where the condition holds and where it does not.
    x.reshape(-1)[: 4 * len(_SPECIAL)] = np.tile(_SPECIAL.astype(dtype), 4)
    y.reshape(-1)[2 : 2 + 4 * len(_SPECIAL)] = np.tile(_SPECIAL.astype(dtype), 4)
    return {"c": rng.random(condition_shape) > 0.5, "x": x, "y": y}


_CASES = {
    "relu backward: Where(c, 0, y)": (np.array(0.0, np.float32), None),
    "masked_fill(0): Where(c, x, 0)": (None, np.array(0.0, np.float32)),
    "masked_fill(-inf): Where(c, -inf, y)": (np.array(-np.inf, np.float32), None),
    "a negative zero: Where(c, x, -0.0)": (None, np.array(-0.0, np.float32)),
    "two computed branches": (None, None),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("condition_shape", [_SHAPE, [32, 32]], ids=["full condition", "broadcast condition"])
def test_the_same_bits_as_where(case: str, condition_shape: list[int]) -> None:
    then, other = _CASES[case]
    model = _where_model(then, other, condition_shape=condition_shape, dtype=TensorProto.FLOAT)
    rewritten = select_by_bit_mask(model)
    assert "Where" not in [n.op_type for n in rewritten.graph.node]
    assert {o.domain: o.version for o in rewritten.opset_import}[""] == BITCAST_OPSET
    feeds = _feeds(condition_shape, np.float32)
    x = feeds["x"] if then is None else then
    y = feeds["y"] if other is None else other
    # torch.where's and numpy's answer, bit for bit: infinities, NaN, denormals, the sign of a zero
    # (ONNX Runtime's own Where returns +0.0 where the selected element is -0.0).
    expected = np.where(feeds["c"], x, y)
    got = _run(rewritten, feeds)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))
    unchanged = _run(model, feeds)
    differs = unchanged.view(np.int32) != expected.view(np.int32)
    assert (expected[differs] == 0).all() and np.signbit(expected[differs]).all()


@pytest.mark.parametrize(
    ("dtype", "numpy_dtype"),
    [(TensorProto.DOUBLE, np.float64), (TensorProto.FLOAT16, np.float16)],
)
def test_other_float_widths(dtype: int, numpy_dtype: type) -> None:
    model = _where_model(np.array(0.0, numpy_dtype), None, condition_shape=_SHAPE, dtype=dtype)
    rewritten = select_by_bit_mask(model)
    assert "Where" not in [n.op_type for n in rewritten.graph.node]
    feeds = _feeds(_SHAPE, numpy_dtype)
    bits = np.dtype(f"int{np.dtype(numpy_dtype).itemsize * 8}")
    expected = np.where(feeds["c"], numpy_dtype(0.0), feeds["y"])
    np.testing.assert_array_equal(_run(rewritten, feeds).view(bits), expected.view(bits))


def test_where_stays_in_a_graph_whose_operators_changed_meaning_by_opset_26() -> None:
    # GroupNormalization-18 takes one scale per group; from 21, one per channel.
    norm = helper.make_node("GroupNormalization", ["out", "s", "b"], ["normed"], num_groups=2)
    model = _where_model(
        np.array(0.0, np.float32), None, condition_shape=_SHAPE, dtype=TensorProto.FLOAT, extra=(norm,)
    )
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.ones(2, np.float32), "s"),
            numpy_helper.from_array(np.zeros(2, np.float32), "b"),
        ]
    )
    assert select_by_bit_mask(model) is model


def _zero_else_model(shape: list[int | str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Where", ["c", "x", "zero"], ["out"])],
        "where",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, shape),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    ("shape", "rewritten"),
    [
        ([8, 128], False),
        (["labels"], False),
        (["rows", 1], False),
        ([128, 128], True),
        (["batch", 1024], True),
    ],
)
def test_small_wheres_stay(shape: list[int | str], rewritten: bool) -> None:
    model = _zero_else_model(shape)
    assert (select_by_bit_mask(model) is not model) == rewritten


def test_integer_wheres_stay() -> None:
    integers = _where_model(np.array(0, np.int64), None, condition_shape=_SHAPE, dtype=TensorProto.INT64)
    assert select_by_bit_mask(integers) is integers


def test_in_the_default_pipeline_last() -> None:
    assert [name for name, _ in default_passes(compute_optimizer=True)][-1] == "select_by_bit_mask"


class _RootOfRelu(torch.nn.Module):
    """sqrt(relu(h)): the gradient of sqrt is infinite exactly where ReLU's backward drops it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 64)
        self.second = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.sqrt(torch.relu(self.first(x)))).pow(2).mean()


def test_relu_backward_drops_infinite_gradients_as_eager_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    x = torch.randn(512, 16)  # [512, 64] activations: not a small Where
    eager, graphs = one_step_against_eager(_RootOfRelu, x, monkeypatch=monkeypatch, tmp_path=tmp_path)
    for name, parameter in eager.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name
    backward = [n.op_type for n in graphs["backward"].graph.node]
    assert "BitCast" in backward and "Where" not in backward
