"""BatchNorm with momentum=None (cumulative averages, what SWA's update_bn sets), captured whole."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain.capture.cumulative_batch_norm import cumulative_batch_norm_traceable


def _same_state(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("layer", "shape"), [(nn.BatchNorm1d, (6, 4)), (nn.BatchNorm2d, (3, 4, 5, 5))], ids=["1d", "2d"]
)
def test_the_traceable_forward_computes_what_pytorch_does(layer: type[nn.Module], shape: tuple) -> None:
    torch.manual_seed(0)
    reference = layer(4, momentum=None)
    traceable = copy.deepcopy(reference)
    for _ in range(3):
        x = torch.randn(shape) * 3 + 1
        want = reference(x)
        with cumulative_batch_norm_traceable():
            got = traceable(x)
        torch.testing.assert_close(got, want)
        _same_state(traceable, reference)
    assert traceable.num_batches_tracked.item() == 3
