"""Factories traced under another default dtype export with the dtype they made."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.export import fx_to_onnx
from ortrain.export.factory_dtypes import spell_out_factory_dtypes
from ortrain.export.fx_to_onnx import export_graph


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _mixed(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` with factories of the default dtype (float64 here): ATen promotes."""
    made = torch.zeros(x.shape[0], 4) + torch.ones(3, 4) + torch.full((3, 4), 2.0) + torch.arange(4.0)
    return x * 2 + made + torch.full((3, 4), 2).to(x.dtype)  # an integer fill stays int64


def test_factories_get_the_dtype_they_made_and_computed_nodes_are_left_alone() -> None:
    with _default_dtype(torch.float64):
        gm = make_fx(_mixed)(torch.randn(3, 4))
    factories = {"aten.zeros.default", "aten.ones.default", "aten.full.default", "aten.arange.default"}
    assert spell_out_factory_dtypes(gm) == 5
    for node in gm.graph.nodes:
        if str(node.target) in factories:
            assert node.kwargs["dtype"] == node.meta["val"].dtype, node
        elif node.op == "call_function" and node.target is torch.ops.aten.mul.Tensor:
            assert "dtype" not in node.kwargs
    assert [n.kwargs["dtype"] for n in gm.graph.nodes if str(n.target) == "aten.full.default"] == [
        torch.float64,
        torch.int64,
    ]
    assert spell_out_factory_dtypes(gm) == 0  # nothing left to spell out


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "torch.onnx.export"])
def test_a_graph_traced_under_float64_exports_and_runs_as_traced(
    direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until wave 33 both paths made the factories float32: ONNX Runtime had no ``Add`` kernel for
    float64 with float32, and an ORTModule trained under float64 fell back to PyTorch."""
    monkeypatch.setattr(fx_to_onnx, "DIRECT_TRANSLATION", direct)
    x = torch.randn(3, 4)
    with _default_dtype(torch.float64):
        gm = make_fx(lambda x: (_mixed(x),))(x)  # the graphs ortrain exports return tuples
        expected = _mixed(x)
    exported = export_graph(gm, opset_version=18)
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-12)
