"""FX graph → ONNX model."""
