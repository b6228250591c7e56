"""Hooks set aside while capturing (DeepSpeed ZeRO-3's, under ORTModule) do not run, and come back."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ortrain.capture.module_hooks import hooks_set_aside


def test_picked_hooks_do_not_run_inside_and_all_come_back_in_order() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    calls: list[str] = []

    def hook(name: str, picked: bool) -> Any:
        def run(*_: object) -> None:
            calls.append(name)

        run.picked = picked  # type: ignore[attr-defined]
        return run

    inner = model[1][0]
    inner.register_forward_pre_hook(hook("kept-pre", False))
    inner.register_forward_pre_hook(hook("picked-pre", True))
    inner.register_forward_hook(hook("picked-post", True))
    model[0].register_forward_hook(hook("kept-post", False))
    x = torch.randn(3, 2)
    with hooks_set_aside(model, lambda h: getattr(h, "picked", False)):
        model(x)
    assert calls == ["kept-post", "kept-pre"]
    calls.clear()
    model(x)
    assert calls == ["kept-post", "kept-pre", "picked-pre", "picked-post"]
