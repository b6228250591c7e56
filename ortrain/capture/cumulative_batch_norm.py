"""BatchNorm with ``momentum=None`` (a cumulative average of the batch statistics), captured whole.

``torch.optim.swa_utils.update_bn`` sets it, and some models train with it. PyTorch's forward then
computes the averaging factor as ``1.0 / float(self.num_batches_tracked)``: a Python number read
from a buffer, which a trace cannot know. The capture failed on it, and the model trained through
TorchDynamo's graph breaks, which printed a graph-break warning and recompiled at every step (the
factor changes) until its recompile limit sent the layer to eager PyTorch.

While capturing, such a layer normalizes with the batch statistics and updates its running
averages with tensor arithmetic on the factor: what PyTorch's CPU kernel computes
(``m * batch + (1 - m) * running``, the variance unbiased), in double as the kernel's Python
momentum is. Every other BatchNorm runs PyTorch's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm


def _cumulative(layer: _BatchNorm) -> bool:
    return (
        layer.momentum is None
        and layer.training
        and layer.track_running_stats
        and layer.num_batches_tracked is not None
        and layer.running_mean is not None
        and layer.running_var is not None
    )


def _forward_with_tensor_factor(layer: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    layer._check_input_dim(input)
    layer.num_batches_tracked.add_(1)
    output = F.batch_norm(input, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)
    with torch.no_grad():
        factor = 1.0 / layer.num_batches_tracked.double()
        dims = [0, *range(2, input.dim())]
        batch = input.double()
        mean = batch.mean(dim=dims)
        # The unbiased variance divides by n - 1 of a double count: torch.onnx translates
        # ``var_mean``'s division by an open size in float32, which a float64 sum cannot meet in
        # ONNX (wave 43: at a new batch size the layer ran in PyTorch, refused under
        # FALLBACK_DISABLE).
        count = torch.scalar_tensor(input.numel() // input.shape[1], dtype=torch.float64)
        shape = [1, -1] + [1] * (input.dim() - 2)
        var = (batch - mean.reshape(shape)).square().sum(dim=dims) / (count - 1)
        for running, batch in ((layer.running_mean, mean), (layer.running_var, var)):
            running.copy_(factor * batch + (1 - factor) * running.double())
    return output


@contextlib.contextmanager
def cumulative_batch_norm_traceable() -> Iterator[None]:
    original = _BatchNorm.forward

    def forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
        if _cumulative(self):
            return _forward_with_tensor_factor(self, input)
        return original(self, input)

    _BatchNorm.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        _BatchNorm.forward = original  # type: ignore[method-assign]
