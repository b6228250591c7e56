"""ortrain: train PyTorch models on ONNX Runtime."""
