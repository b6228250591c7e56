"""``torch.nn.utils.parametrize.cached()`` around calls of a wrapped model.

Inside ``cached()`` eager PyTorch computes each parametrized tensor once (spectral norm's power
iteration, an orthogonal map) and every later call in the block reads that tensor, its autograd
graph included. A captured graph computes the parametrization at every call, so two calls in one
block ran the power iteration twice (``_u``/``_v`` and the weight's gradient off, silently), and
a capture inside the block left a traced value in the cache (the next call failed). Such calls run
in PyTorch (``ortmodule.py``), which shares the cache as eager does.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize


def parametrizations_cached(module: nn.Module) -> bool:
    """Whether ``cached()`` is active and ``module`` holds a parametrized tensor."""
    return parametrize._cache_enabled > 0 and any(parametrize.is_parametrized(m) for m in module.modules())
