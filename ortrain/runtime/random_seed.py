"""ONNX Runtime's random operators draw from PyTorch's generator, so ``torch.manual_seed`` repeats a run.

ONNX Runtime's Dropout and Random* kernels (without a ``seed`` attribute, as exported) draw from
one process-wide generator seeded from the clock: the same script trained twice with the same
``torch.manual_seed`` got other dropout masks, other losses, and could not be compared with itself
(or with a cached run). Before each run of a session that holds such an operator, ortrain reseeds
that generator with a number drawn from PyTorch's default generator, so the masks follow the
user's seed (and ``torch.random.fork_rng`` / ``get_rng_state`` work as for eager dropout).

Since wave 19 no operator ortrain exports draws from that generator: dropout and the other random
operators run in PyTorch (:mod:`ortrain.runtime.torch_native_ops`), whose masks do not depend on
the placement or the graph. The reseeding stays for a graph that holds such an operator anyway
(a custom translation, an ONNX model from elsewhere).
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import torch

# Operators whose output depends on ONNX Runtime's generator (when they carry no seed attribute).
RANDOM_OPS = frozenset(
    {
        "Dropout",
        "BitmaskDropout",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
    }
)
_SEED_BOUND = 2**62


def has_random_ops(model: onnx.ModelProto) -> bool:
    def unseeded(node: onnx.NodeProto) -> bool:
        return node.op_type in RANDOM_OPS and not any(a.name == "seed" for a in node.attribute)

    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    return any(unseeded(n) for n in nodes)


def seed_onnxruntime_from_torch() -> None:
    """Reseed ONNX Runtime's generator from PyTorch's default CPU generator (one draw)."""
    ort.set_seed(int(torch.randint(_SEED_BOUND, (), dtype=torch.int64)))
