"""Max and min reductions propagate NaN in ONNX Runtime as in PyTorch (wave 37: ONNX Runtime's
ReduceMax, ReduceMin, ArgMax and ArgMin skip NaN)."""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.export import fx_to_onnx
from ortrain.export.nan_propagation import propagate_nan

NAN = float("nan")
ROWS = torch.tensor([[1.0, NAN, 3.0, 2.0], [0.0, 3.0, 1.0, 3.0], [NAN, NAN, NAN, NAN], [5.0, 1.0, NAN, 2.0]])


def _reductions(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    most, where_most = x.max(1)
    least, where_least = x.min(0, keepdim=True)
    return (
        x.amax(1),
        x.amin((0, 1)),
        x.max(),
        x[1].min(),
        most,
        where_most,
        least,
        where_least,
        x.argmax(1),
        x.argmin(),
        x.abs().amax((0, 1), keepdim=True),
        torch.linalg.vector_norm(x, float("inf"), dim=1),
        torch.linalg.vector_norm(x, -float("inf")),
        # PyTorch's pooling points at each window's last NaN
        *F.max_pool2d(x[None, None], 2, 1, return_indices=True),
        *F.max_pool2d(x[None, None], 3, 2, 1, return_indices=True),
        *F.max_pool3d(x[None, None, None], (1, 2, 3), return_indices=True),
    )


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "torch.onnx.export"])
@pytest.mark.parametrize("data", ["with NaN", "without NaN"])
def test_onnx_runtime_gives_pytorchs_maxima_and_minima(direct: bool, data: str, monkeypatch) -> None:
    monkeypatch.setattr(fx_to_onnx, "DIRECT_TRANSLATION", direct)
    x = ROWS if data == "with NaN" else torch.nan_to_num(ROWS, 4.0)
    exported = fx_to_onnx.export_graph(make_fx(_reductions, tracing_mode="fake")(x), opset_version=18)
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    results = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for got, expected in zip(results, _reductions(x), strict=True):
        torch.testing.assert_close(torch.from_numpy(np.asarray(got)), expected, equal_nan=True)


def test_only_reductions_of_floats_are_rewritten() -> None:
    def reductions(x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.amax(0), n.amax(0), n.argmax(), torch.linalg.vector_norm(x, 2)

    gm = make_fx(reductions, tracing_mode="fake")(ROWS, torch.arange(4))
    assert propagate_nan(gm) == 1


class _NanCheck(nn.Module):
    """A forward that reduces its activations to decide, as a divergence check does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.linear(x)
        middle, where = h.median(1)
        return h.abs().amax(), torch.log(h).argmax(1), middle, where, F.max_pool1d(h[None], 2)


def test_a_nan_in_the_activations_reaches_the_outputs_as_in_eager() -> None:
    torch.manual_seed(0)
    eager = _NanCheck()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    x[1, 2] = NAN
    for got, expected in zip(wrapped(x), eager(x), strict=True):
        torch.testing.assert_close(got, expected, equal_nan=True)


def test_the_nan_positions_of_a_float64_pooling_stay_float64() -> None:
    """Pooling's NaN positions were float32 in every graph: a float64 graph then held a float32
    node, and the export rounded all its Python numbers to float32 (a bilinear upsampling's
    weights before an adaptive max pooling: 1.5e-6 off eager, wave 44)."""

    def pooled(x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(x, 2)

    gm = make_fx(pooled, tracing_mode="fake")(torch.randn(1, 1, 4, 4, dtype=torch.float64))
    assert propagate_nan(gm) == 1
    floating = {
        n.meta["val"].dtype
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()
    }
    assert floating == {torch.float64}
