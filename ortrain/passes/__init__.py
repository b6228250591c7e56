"""ONNX → ONNX rewrites, one per file, applied in the order listed in :mod:`ortrain.passes.pipeline`."""
