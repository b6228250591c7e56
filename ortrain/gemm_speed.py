"""How fast each library multiplies matrices on this machine, on a model's own shapes.

Whether ONNX Runtime (MLAS) or PyTorch (oneDNN/MKL/OpenBLAS) is faster at matrix products differs
from one CPU to another, and matrix products are most of a transformer's step. The benchmark
prints both figures beside the step times so a reader can tell why ortrain wins or loses there.

The shapes come from one eager training step run under a dispatch mode that records every
``mm``/``addmm``/``bmm`` (forward and backward); each distinct shape is timed alone in both
libraries and weighted by how often the step runs it.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

Shape = tuple[int, ...]  # (batch, m, k, n); batch 0 for a plain 2-D product


class _RecordProducts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: Counter[Shape] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.mm.default, aten.addmm.default):
            a, b = (args[0], args[1]) if func is aten.mm.default else (args[1], args[2])
            if a.dtype == torch.float32:
                self.shapes[(0, a.shape[0], a.shape[1], b.shape[1])] += 1
        elif func is aten.bmm.default and args[0].dtype == torch.float32:
            a, b = args
            self.shapes[(a.shape[0], a.shape[1], a.shape[2], b.shape[2])] += 1
        return func(*args, **kwargs)


def product_shapes(step: Callable[[], None]) -> Counter[Shape]:
    """The float32 matrix products one call of ``step`` runs (an eager forward and backward)."""
    recorder = _RecordProducts()
    with recorder:
        step()
    return recorder.shapes


def _flops(shape: Shape) -> float:
    batch, m, k, n = shape
    return 2.0 * max(batch, 1) * m * k * n


def _operands(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    batch, m, k, n = shape
    lead = (batch,) if batch else ()
    return torch.randn(*lead, m, k), torch.randn(*lead, k, n)


def _median_seconds(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm-up: first-call allocations, thread pool start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _onnxruntime_matmul(shape: Shape) -> ort.InferenceSession:
    batch, m, k, n = shape
    lead = [batch] if batch else []
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "matmul",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [*lead, m, k]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [*lead, k, n]),
        ],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [*lead, m, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as ortrain's sessions
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def gemm_gflops(shapes: Counter[Shape], *, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of ``torch`` and ``onnxruntime`` over ``shapes``, each weighted by its count."""
    seconds = {"torch": 0.0, "onnxruntime": 0.0}
    total = 0.0
    for shape, count in shapes.items():
        a, b = _operands(shape)
        session = _onnxruntime_matmul(shape)
        feeds = {"a": a.numpy(), "b": b.numpy()}
        matmul = torch.bmm if shape[0] else torch.mm
        seconds["torch"] += count * _median_seconds(lambda: matmul(a, b), repeats)  # noqa: B023
        seconds["onnxruntime"] += count * _median_seconds(lambda: session.run(None, feeds), repeats)  # noqa: B023
        total += count * _flops(shape)
    return {library: total / s / 1e9 if s else 0.0 for library, s in seconds.items()}
