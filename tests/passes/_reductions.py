"""One ONNX reduction node over an input ``x`` with constant axes, and running it, for pass tests."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def reduction_model(
    op_type: str,
    shape: list[int | str],
    axes: list[int],
    *,
    keepdims: int = 1,
    dtype: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x", "axes"], ["y"], keepdims=keepdims)],
        op_type,
        [helper.make_tensor_value_info("x", dtype, shape)],
        [helper.make_tensor_value_info("y", dtype, None)],
        [numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def run_on_cpu(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]
