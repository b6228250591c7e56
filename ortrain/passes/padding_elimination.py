"""Embedding sparsity / padding elimination (``ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER``)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("ortrain.passes")


def eliminate_padding(gm: torch.fx.GraphModule) -> list[str]:
    return []
