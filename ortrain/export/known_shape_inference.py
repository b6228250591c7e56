"""onnxscript's constant folding without ONNX shape inference of nodes whose outputs are known.

``torch.onnx.export(optimize=True)`` (and ortrain's node-by-node translation, which runs the same
optimizer) folds constants node by node, and before folding each node it runs ONNX's shape
inference on that one node: its inputs' types serialized to protos, the node serialized, the
result parsed back. Every node is visited in each of the optimizer's two rounds, though the
exporter already wrote the dtype and the shape of every value an FX node makes, and the first
round filled most of the rest: on the tiny GPT it was 0.2 s of a 1.0 s export (2-core AMD EPYC).

Where every output of a node already has a dtype and a shape of fixed sizes, the inference can
only confirm them (the folder keeps the known sizes, preferring them over inferred ones), so it is
skipped; a node with any output of unknown type, unknown rank or a symbolic size is inferred as
before. The optimized models are byte-identical (``tests/export/test_known_shape_inference.py``
checks the tiny GPT's static and dynamic graphs). While ortrain exports, onnxscript's folding pass
is swapped for this one (exports are serialized by ortrain's compile lock). The same pass leaves
alone a ``SplitToSequence`` whose chunk size is computed, on which onnxscript's folding fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from onnxscript.optimizer import _constant_folding


def _known(value: Any) -> bool:
    if value is None:
        return True  # an omitted optional output
    shape = value.shape
    return value.type is not None and shape is not None and all(isinstance(d, int) for d in shape)


def _split_of_unknown_scalar_size(node: Any) -> bool:
    """``SplitToSequence`` by one chunk size that is computed (``x.split(n // 4)`` with a symbolic
    ``n``): onnxscript 0.7's evaluator of the node reads the size's value, which is unknown, and
    fails ("'NoneType' object has no attribute 'ndim'"), failing the export of the whole region
    (ProphetNet's forward: 141 nodes in PyTorch). There is nothing to fold in it."""
    if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return False
    split = node.inputs[1]
    return (
        split is not None
        and split.const_value is None
        and split.shape is not None
        and split.shape.rank() == 0
    )


class _FoldConstantsWhereUnknown(_constant_folding.FoldConstantsPass):
    def _do_inference(self, node: Any) -> None:
        if all(_known(output) for output in node.outputs):
            return
        super()._do_inference(node)

    def process_node(self, node: Any, is_function: bool) -> Any:
        if _split_of_unknown_scalar_size(node):
            return None
        return super().process_node(node, is_function)


@contextlib.contextmanager
def shape_inference_only_where_unknown() -> Iterator[None]:
    """While exporting: constant folding infers the shapes only of nodes with an unknown output."""
    original = _constant_folding.FoldConstantsPass
    _constant_folding.FoldConstantsPass = _FoldConstantsWhereUnknown
    try:
        yield
    finally:
        _constant_folding.FoldConstantsPass = original
