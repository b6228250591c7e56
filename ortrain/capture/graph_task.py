"""What the autograd engine's running backward was asked for, read from inside a node's backward."""

from __future__ import annotations

import torch


def backward_keeps_graph() -> bool:
    """Whether the backward that runs this node keeps the graph (``retain_graph=True``, or
    ``create_graph=True``, which implies it): a node that runs a graph of its own in its backward
    keeps that one alive only then, and otherwise lets it free each saved tensor after its last use."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())
