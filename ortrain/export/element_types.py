"""PyTorch dtypes and the ONNX element types they are exchanged as."""

from __future__ import annotations

import onnx
import torch

ONNX_ELEMENT_TYPES: dict[torch.dtype, int] = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.bool: onnx.TensorProto.BOOL,
}
