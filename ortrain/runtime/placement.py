"""Placements: which operator groups of a graph run in PyTorch although ONNX Runtime could run them.

ONNX Runtime's and PyTorch's CPU kernels differ in speed from one CPU to another (MLAS's matrix
products beat oneDNN's on some AMD EPYCs and lose on some Intel Xeons) and PyTorch has single-pass
kernels for backward ops that ONNX Runtime's CPU build only has as chains of elementwise nodes.
A placement names the operator groups handed to PyTorch; the tuner
(:mod:`ortrain.runtime.placement_tuning`) measures a few of them on the real graph and keeps the
fastest. The default placement gives ONNX Runtime everything it can run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten

# Each group is an operator family whose kernels differ between the two libraries as a whole.
OP_GROUPS: dict[str, frozenset[object]] = {
    # Matrix products: the bulk of a transformer's time, MLAS against oneDNN/MKL.
    "matmul": frozenset(
        {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default}
    ),
    # Ops PyTorch runs as one pass over memory where ONNX Runtime's CPU build (no training
    # kernels) runs their exported translation as a chain of elementwise nodes and reductions.
    "fused": frozenset(
        {
            aten.gelu_backward.default,
            aten.native_layer_norm_backward.default,
            aten._softmax_backward_data.default,
            aten._log_softmax_backward_data.default,
            aten.embedding_dense_backward.default,
            aten.nll_loss_backward.default,
            aten.threshold_backward.default,
            aten.native_layer_norm.default,
            aten._softmax.default,
            aten._log_softmax.default,
            aten.gelu.default,
        }
    ),
}


# Backward ops whose ONNX translation keeps several activation-sized temporaries alive at once,
# left to PyTorch's one-pass kernel (one output) at ORTMODULE_MEMORY_OPT_LEVEL >= 1. gelu_backward
# is eleven elementwise nodes in ONNX Runtime's CPU build: tiny GPT, batch 36, sequence 512, level 1,
# the last layer's first backward region peaked 387 MiB above its start with it, 242 without, and
# the step ran 5-10 % faster; at batch 8 neutral (two crossings a layer against passes saved).
MEMORY_LEVEL_TORCH_OPS: frozenset[object] = frozenset({aten.gelu_backward.default})


def memory_level_declined(level: int, graph_name: str) -> frozenset[object]:
    """The operators ONNX Runtime leaves to PyTorch in ``graph_name`` at memory optimizer ``level``."""
    return MEMORY_LEVEL_TORCH_OPS if level >= 1 and graph_name == "backward" else frozenset()


@dataclass(frozen=True)
class Placement:
    """``torch_groups``: the groups PyTorch runs; ``all_torch``: PyTorch runs the whole graph."""

    torch_groups: frozenset[str] = frozenset()
    all_torch: bool = False

    @property
    def name(self) -> str:
        if self.all_torch:
            return "all-torch"
        if not self.torch_groups:
            return "onnxruntime"
        return "+".join(sorted(self.torch_groups)) + "-in-torch"

    @property
    def declined(self) -> frozenset[object]:
        """The operators ONNX Runtime leaves to PyTorch under this placement."""
        return frozenset().union(*(OP_GROUPS[g] for g in self.torch_groups))

    @classmethod
    def from_name(cls, name: str) -> Placement:
        """The inverse of :attr:`name` (for the tuning results file)."""
        if name == "all-torch":
            return cls(all_torch=True)
        if name == "onnxruntime":
            return cls()
        groups = frozenset(name.removesuffix("-in-torch").split("+"))
        unknown = groups - OP_GROUPS.keys()
        if not name.endswith("-in-torch") or unknown:
            raise ValueError(f"unknown placement {name!r}")
        return cls(groups)


DEFAULT = Placement()


def candidates(graph: torch.fx.GraphModule, *, mixed: bool = True) -> list[Placement]:
    """The placements worth measuring for ``graph``, default first, cheapest to build next.

    All-torch needs no export, so it comes before the mixed placements (only with ``mixed``),
    which export one ONNX region per stretch between PyTorch nodes. A group absent from the graph
    makes no candidate.
    """
    found = [DEFAULT, Placement(all_torch=True)]
    if not mixed:
        return found
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    present = [g for g, ops in OP_GROUPS.items() if targets & ops]
    found += [Placement(frozenset({g})) for g in present]
    if len(present) > 1:
        found.append(Placement(frozenset(present)))
    return found
