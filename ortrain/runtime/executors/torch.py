"""The torch executor: runs a region's FX nodes in PyTorch. It claims every node, so it is the
universal last resort (and, for a whole graph, the reference the other executors match)."""

from __future__ import annotations

from typing import Any

import torch

from ortrain.runtime.executors.base import Runner


class TorchExecutor:
    name = "torch"
    merges = True

    def claims(self, node: torch.fx.Node) -> bool:
        return True

    def refusal(self, node: torch.fx.Node) -> str | None:
        return None

    def build(self, region: torch.fx.GraphModule, *, what: str, whole: bool) -> Runner:
        def run(args: list[Any]) -> list[Any]:
            return list(region(*args))

        run.region = region  # type: ignore[attr-defined]
        return run
