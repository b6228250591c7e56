"""Operator coverage of ortrain, measured over PyTorch's own operator database (``op_db``).

For every OpInfo that supports autograd on the CPU in float32, a module applies the op to its
sample input made learnable (every floating tensor that OpInfo marks ``requires_grad`` becomes an
``nn.Parameter``), returns the op's output as is (``torch.return_types`` included) and trains one
step under ``ORTModule`` with ``FALLBACK_DISABLE``. Outputs and gradients are compared with eager
PyTorch at the tolerances OpInfo itself uses (float32 defaults, widened by the op's own
``toleranceOverride`` for float32). Each op lands in one bucket:

- ``onnxruntime``: trains with parity, every graph runs in ONNX Runtime;
- ``partly_torch_executor``: trains with parity, part of a graph runs in another executor;
- ``capture_fails`` / ``export_fails`` / ``session_fails``: the stage that raised;
- ``wrong_values``: ran but outputs or gradients differ from eager;
- ``timed_out``: took longer than ``--timeout`` seconds;
- ``not_compared``: the op is random (it calls an op tagged ``nondeterministic_seeded``, or two
  eager runs with different seeds differ): it must still run under ORTModule (else it lands in
  the bucket of the stage that failed), but ONNX Runtime's generator is not PyTorch's, so values
  cannot be compared; or eager PyTorch itself rejects every sample tried.

Usage (slow: about 540 ops, a few seconds each; nice it on a shared machine)::

    nice -n 19 python tools/opinfo_sweep.py --json opinfo_sweep.json
    python tools/opinfo_sweep.py --ops nn.functional.avg_pool2d cumprod   # a few ops, verbose
    python tools/opinfo_sweep.py --ci                                     # the CI subset

The CI subset (``CI_OPS``) runs in the test suite: ops are grouped into a few modules so that a
handful of captures cover all of them (``check_grouped``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

BUCKETS = (
    "onnxruntime",
    "partly_torch_executor",
    "capture_fails",
    "export_fails",
    "session_fails",
    "wrong_values",
    "timed_out",
    "not_compared",
)
PASSING = ("onnxruntime", "partly_torch_executor")

# The most common ops in real models, checked in CI (tests/ortmodule/test_opinfo_subset.py).
CI_OPS = (
    # elementwise and activations
    "add", "sub", "mul", "div.no_rounding_mode", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "clamp",
    "where", "sigmoid", "tanh", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu",
    "nn.functional.softplus", "nn.functional.leaky_relu", "nn.functional.hardtanh", "erf",
    # linear algebra
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "einsum",
    # reductions, with indices too
    "sum", "mean", "var", "amax", "max.reduction_with_dim", "min.reduction_with_dim", "scatter",
    "logsumexp", "cumsum", "topk", "sort",
    # shape and indexing
    "cat", "stack", "reshape", "permute", "transpose", "narrow", "index_select", "gather",
    "scatter_add", "take_along_dim", "masked_fill", "nn.functional.pad.constant",
    "nn.functional.pad.reflect", "unfold",
    # normalization, softmax, pooling, convolution, embedding, interpolation
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.group_norm",
    "nn.functional.batch_norm", "nn.functional.conv2d", "nn.functional.conv_transpose2d",
    "nn.functional.avg_pool2d", "nn.functional.max_pool2d", "nn.functional.adaptive_avg_pool2d",
    "nn.functional.embedding", "nn.functional.interpolate.bilinear",
    # losses
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.smooth_l1_loss",
)  # fmt: skip

_DEFAULT_TOL = (1e-5, 1.3e-6)  # float32 (atol, rtol), as torch.testing.assert_close
# OpInfo tests whose float32 tolerance overrides describe an op's eager numerics.
_TOLERANCE_TESTS = {
    None,
    "test_noncontiguous_samples",
    "test_variant_consistency_eager",
    "test_python_ref",
    "test_python_ref_torch_fallback",
    "test_out",
    "test_fn_grad",
    "test_fn_gradgrad",
    "test_comprehensive",
}


def op_id(opinfo: Any) -> str:
    return f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name


def swept_ops() -> list[Any]:
    """Every OpInfo with autograd on the CPU in float32."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if o.supports_autograd and torch.float32 in o.supported_dtypes("cpu")]


def tolerance(opinfo: Any) -> tuple[float, float]:
    """OpInfo's float32 tolerance for this op: the defaults widened by its CPU overrides."""
    from torch.testing._internal.common_device_type import toleranceOverride

    atol, rtol = _DEFAULT_TOL
    for info in getattr(opinfo, "decorators", ()) or ():
        if getattr(info, "device_type", None) not in (None, "cpu"):
            continue
        if getattr(info, "test_name", None) not in _TOLERANCE_TESTS:
            continue
        for decorator in getattr(info, "decorators", ()):
            if isinstance(decorator, toleranceOverride) and torch.float32 in decorator.d:
                tol = decorator.d[torch.float32]
                atol, rtol = max(atol, tol.atol), max(rtol, tol.rtol)
    return atol, rtol


@dataclass
class Case:
    """One op applied to one sample input."""

    name: str
    op: Callable[..., Any]
    sample: Any
    tol: tuple[float, float]


@dataclass
class Result:
    op: str
    bucket: str
    error: str = ""
    seconds: float = 0.0
    executors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _without_reseeding() -> Iterator[None]:
    """OpInfo wraps random ops in ``wrapper_set_seed``, which reseeds torch's generator inside the
    call so that two eager runs agree; the sweep seeds before each run itself. Inside a forward a
    reseed is Python that a captured graph cannot repeat (ORTModule trains such a model through
    graph breaks), which is not what the sweep measures: the op runs unwrapped."""
    from torch.testing._internal import common_methods_invocations as opinfo

    wrapper = opinfo.wrapper_set_seed
    opinfo.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    try:
        yield
    finally:
        opinfo.wrapper_set_seed = wrapper


class OpsModule(nn.Module):
    """Applies each case's op to its sample, with the sample's differentiable tensors as parameters."""

    def __init__(self, cases: Sequence[Case]) -> None:
        super().__init__()
        self.cases = list(cases)
        self.weights = nn.ParameterList()
        self.layouts: list[tuple[Any, list[tuple[str, Any]]]] = []
        self.param_owner: list[int] = []  # case index of each parameter
        for index, case in enumerate(self.cases):
            sample = case.sample
            leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
            slots: list[tuple[str, Any]] = []
            for j, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
                    self.weights.append(nn.Parameter(leaf.detach().clone()))
                    self.param_owner.append(index)
                    slots.append(("param", len(self.weights) - 1))
                elif isinstance(leaf, torch.Tensor):
                    name = f"const_{index}_{j}"
                    self.register_buffer(name, leaf.detach().clone(), persistent=False)
                    slots.append(("buffer", name))
                else:
                    slots.append(("const", leaf))
            self.layouts.append((spec, slots))

    def forward(self) -> tuple[Any, ...]:
        outputs = []
        for case, (spec, slots) in zip(self.cases, self.layouts, strict=True):
            leaves = []
            for kind, ref in slots:
                if kind == "param":
                    leaves.append(self.weights[ref])
                elif kind == "buffer":
                    leaves.append(getattr(self, ref))
                else:
                    leaves.append(ref)
            sample_input, args, kwargs = pytree.tree_unflatten(leaves, spec)
            with _without_reseeding():
                out = case.op(sample_input, *args, **kwargs)
            outputs.append(case.sample.output_process_fn_grad(out))
        return tuple(outputs)


def _loss(outputs: Any) -> torch.Tensor | None:
    """A weighted sum of every differentiable output, with fixed pseudo-random weights."""
    generator = torch.Generator().manual_seed(1234)
    total = None
    for leaf in pytree.tree_leaves(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
            weight = torch.rand(leaf.shape, generator=generator, dtype=leaf.dtype) + 0.5
            term = (leaf * weight).sum()
            total = term if total is None else total + term
    return total


def _step(module: nn.Module, params: list[nn.Parameter]) -> tuple[Any, list[torch.Tensor | None]]:
    outputs = module()
    loss = _loss(outputs)
    if loss is not None:
        loss.backward()
    return outputs, [p.grad for p in params]


def _close(got: Any, want: Any, tol: tuple[float, float]) -> str:
    """An empty string if ``got`` matches ``want``, else the first mismatch."""
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} values where eager has {len(want_leaves)}"
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"value {i}: {type(a).__name__} where eager has a tensor"
            if a.dtype != b.dtype:
                return f"value {i}: dtype {a.dtype} where eager has {b.dtype}"
            try:
                torch.testing.assert_close(a, b, atol=tol[0], rtol=tol[1], equal_nan=True, check_stride=False)
            except AssertionError as error:
                return f"value {i}: " + " ".join(str(error).split())[:300]
        elif a != b and not (a != a and b != b):  # NaN == NaN here
            return f"value {i}: {a!r} where eager has {b!r}"
    return ""


def _grads_close(got: list[Any], want: list[Any], tol: tuple[float, float]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        mismatch = _close(a, b, tol)
        if mismatch:
            return f"gradient {i}: {mismatch}"
    return ""


def _reference64(module: nn.Module) -> tuple[Any, list[Any]] | None:
    """Outputs and gradients in float64, to tell float32 rounding apart from wrong values."""
    try:
        double = copy.deepcopy(module).double()
        params = list(double.weights)
        outputs, grads = _step(double, params)
        return outputs, grads
    except Exception:
        return None


def _within_rounding(got: Any, eager: Any, ref: Any, tol: tuple[float, float]) -> bool:
    """``got`` is as close to the float64 result as eager float32 is (within 4x, plus tolerance)."""
    got_l, eager_l, ref_l = (pytree.tree_leaves(v) for v in (got, eager, ref))
    if not len(got_l) == len(eager_l) == len(ref_l):
        return False
    for a, e, r in zip(got_l, eager_l, ref_l, strict=True):
        if not isinstance(e, torch.Tensor) or not e.is_floating_point():
            continue
        if a is None or r is None:
            return False
        r = r.to(e.dtype)
        eager_err = (e - r).abs().nan_to_num(0).max().item() if e.numel() else 0.0
        try:
            torch.testing.assert_close(a, r, atol=tol[0] + 4 * eager_err, rtol=tol[1], equal_nan=True)
        except AssertionError:
            return False
    return True


class _SeededOps(TorchDispatchMode):
    """Records the random ops (tagged ``nondeterministic_seeded``) that a computation calls."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def random_ops(case: Case) -> list[str]:
    """Why the op's values cannot be compared with eager's: the random ops it calls (OpInfo wraps
    many in ``wrapper_set_seed``, which reseeds torch's generator so that two eager runs agree,
    but ONNX Runtime draws from its own generator), or a note that two eager runs with different
    seeds differ. Empty for a deterministic op."""
    module = OpsModule([case])
    with torch.no_grad():
        with _SeededOps() as seeded:
            torch.manual_seed(0)
            first = module()
        torch.manual_seed(1)
        second = module()
    if seeded.seen:
        return sorted(seeded.seen)
    return ["values differ between eager runs"] if _close(first, second, (0.0, 0.0)) else []


def executor_kinds(runner: Any) -> set[str]:
    """Which executors run a graph ("onnxruntime", "torch", "python op"): those given nodes by the
    graph's partition plan."""
    if runner is None:
        return set()
    plan = getattr(runner, "plan", None)
    if plan is None:
        return {type(runner).__name__}
    return {name for name, count in plan.nodes_by_executor().items() if count}


def _wrapped_executors(wrapped: Any) -> set[str]:
    kinds: set[str] = set()
    for entries in wrapped._ortrain_graphs.values():
        for entry in entries:
            kinds |= executor_kinds(entry.capture.forward.runner)
            if entry.capture.backward is not None:
                kinds |= executor_kinds(entry.capture.backward.runner)
    return kinds


_NO_TRANSLATION = "no ONNX translation"


def classify(error: BaseException) -> str:
    """The stage that raised ``error``."""
    from ortrain.export.fx_to_onnx import ExportError
    from ortrain.ortmodule.fallback import (
        ORTModuleIOError,
        ORTModuleONNXModelException,
        ORTModuleTorchModelException,
    )

    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    if any(isinstance(e, ExportError) for e in chain) or _NO_TRANSLATION in str(error):
        # The partitioner refuses an op without translation before exporting: an export failure.
        return "export_fails"
    if isinstance(error, (ORTModuleTorchModelException, ORTModuleIOError)):
        return "capture_fails"
    if isinstance(error, ORTModuleONNXModelException):
        return "session_fails"
    if any(type(e).__module__.startswith("onnxruntime") for e in chain):
        return "session_fails"
    return (
        "session_fails"
        if "onnxruntime" in "".join(traceback.format_tb(error.__traceback__))
        else "capture_fails"
    )


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300]


def check_grouped(cases: Sequence[Case], *, compare: bool = True) -> list[Result]:
    """Train one step of one module applying every case, under ORTModule and eagerly; compare
    (unless ``compare`` is false: random ops, which only have to run).

    One capture covers all cases. A failure of the group is the failure of each of its cases
    (run them alone to find the culprit).
    """
    from ortrain import ORTModule

    start = time.perf_counter()
    torch.manual_seed(0)
    module = OpsModule(cases)
    eager = copy.deepcopy(module)
    reference64 = copy.deepcopy(module)
    want_out, want_grads = _step(eager, list(eager.weights))
    wrapped = ORTModule(module)
    try:
        got_out, got_grads = _step(wrapped, list(module.weights))
    except Exception as error:
        seconds = time.perf_counter() - start
        return [Result(c.name, classify(error), first_line(error), seconds) for c in cases]
    fallback = wrapped._ortrain_fallback.reason
    if fallback is not None:  # the policy let PyTorch run the whole model: that is no pass
        seconds = time.perf_counter() - start
        return [Result(c.name, classify(fallback), first_line(fallback), seconds) for c in cases]
    kinds = _wrapped_executors(wrapped)
    if wrapped._ortrain_graph_breaks is not None:
        # Whole-graph capture failed and TorchDynamo split the model: the code between its graphs
        # runs in eager PyTorch (the failing op among it, perhaps), so this is no ONNX Runtime pass.
        kinds.add("torch (between graph breaks)")
    seconds = time.perf_counter() - start
    bucket = "onnxruntime" if kinds <= {"onnxruntime"} else "partly_torch_executor"
    results = []
    for index, case in enumerate(cases):
        mine = [i for i, owner in enumerate(module.param_owner) if owner == index]
        mismatch = (
            _close(got_out[index], want_out[index], case.tol)
            or _grads_close([got_grads[i] for i in mine], [want_grads[i] for i in mine], case.tol)
            if compare
            else ""
        )
        reference = _reference64(reference64) if mismatch else None
        if mismatch and reference is not None:
            ref_out, ref_grads = reference
            rounding = _within_rounding(got_out[index], want_out[index], ref_out[index], case.tol)
            rounding = rounding and _within_rounding(
                [got_grads[i] for i in mine],
                [want_grads[i] for i in mine],
                [ref_grads[i] for i in mine],
                case.tol,
            )
            if rounding:
                mismatch = ""
        if mismatch:
            results.append(Result(case.name, "wrong_values", mismatch, seconds, sorted(kinds)))
        else:
            results.append(Result(case.name, bucket, "", seconds, sorted(kinds)))
    return results


def cases_for(opinfo: Any, max_samples: int = 1) -> tuple[list[Case], str]:
    """Up to ``max_samples`` samples of ``opinfo`` that eager PyTorch runs with a gradient."""
    cases: list[Case] = []
    reason = "no sample input"
    tol = tolerance(opinfo)
    torch.manual_seed(0)
    samples = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=True))
    # Samples on tensors of at least one dimension first: those are what models run; OpInfo often
    # lists a 0-d edge case first.
    samples.sort(key=lambda s: not (isinstance(s.input, torch.Tensor) and s.input.dim() >= 1))
    for sample in samples:
        case = Case(op_id(opinfo), opinfo.op, sample, tol)
        try:
            outputs = OpsModule([case])()
        except Exception as error:
            reason = f"eager rejects the sample: {first_line(error)}"
            continue
        if _loss(outputs) is None:
            reason = "no differentiable output"
            continue
        cases.append(case)
        if len(cases) >= max_samples:
            break
    return cases, reason


def check_op(opinfo: Any, max_samples: int = 1) -> Result:
    start = time.perf_counter()
    cases, reason = cases_for(opinfo, max_samples)
    if not cases:
        return Result(op_id(opinfo), "not_compared", reason, time.perf_counter() - start)
    draws = [random_ops(case) for case in cases]
    if all(draws):
        # A sample that draws nothing (dropout off, say) can still be compared value for value.
        deterministic = [c for c in cases_for(opinfo, 16)[0] if not random_ops(c)]
        if deterministic:
            cases = deterministic[:max_samples]
            draws = [[] for _ in cases]
    worst: Result | None = None
    for case, drawn in zip(cases, draws, strict=True):
        # A sample that draws random numbers only has to run: ONNX Runtime's generator is not eager's.
        (result,) = check_grouped([case], compare=not drawn)
        if worst is None or BUCKETS.index(result.bucket) > BUCKETS.index(worst.bucket):
            worst = result
    assert worst is not None
    if all(draws) and worst.bucket in PASSING:
        # It ran under ORTModule (a failure to run is still counted as one), but no sample's values
        # could be compared.
        randomness = sorted({op for drawn in draws for op in drawn})
        worst = Result(
            worst.op,
            "not_compared",
            f"random op ({', '.join(randomness)}): ran, values not comparable",
            executors=worst.executors,
        )
    worst.seconds = time.perf_counter() - start
    return worst


# ---- the sweep, one worker process restarted on timeouts ------------------------------------------


def _worker(conn: Any, max_samples: int) -> None:
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    ops = {op_id(o): o for o in swept_ops()}
    conn.send("ready")  # importing torch's op database is not the first op's time
    while True:
        name = conn.recv()
        if name is None:
            return
        try:
            result = check_op(ops[name], max_samples)
        except Exception as error:  # the harness itself failed on this op: record, go on
            result = Result(name, classify(error), first_line(error))
        conn.send(asdict(result))


def sweep(
    names: Iterable[str],
    *,
    timeout: float,
    max_samples: int,
    log: Callable[[str], None],
    done: Callable[[list[Result]], None] = lambda results: None,
) -> list[Result]:
    """Check each op in a worker process, killed and restarted when an op takes over ``timeout``;
    ``done`` sees the results so far after each op (to save them as they come)."""
    context = mp.get_context("spawn")
    results: list[Result] = []
    process = conn = None
    for name in names:
        if process is None:
            conn, child = context.Pipe()
            process = context.Process(target=_worker, args=(child, max_samples), daemon=True)
            process.start()
            assert conn.recv() == "ready"
        assert conn is not None
        conn.send(name)
        if conn.poll(timeout):
            result = Result(**conn.recv())
        else:
            process.kill()
            process.join()
            process = None
            result = Result(name, "timed_out", f"more than {timeout:.0f} s", timeout)
        results.append(result)
        done(results)
        log(f"{len(results):4d} {result.bucket:22s} {result.seconds:6.1f}s {name} {result.error[:120]}")
    if process is not None:
        assert conn is not None
        conn.send(None)
        process.join(timeout=10)
    return results


def summary(results: Sequence[Result]) -> dict[str, Any]:
    counts = {b: sum(r.bucket == b for r in results) for b in BUCKETS}
    compared = len(results) - counts["not_compared"]
    passing = counts["onnxruntime"] + counts["partly_torch_executor"]
    return {
        "torch": torch.__version__,
        "policy": os.environ["ORTMODULE_FALLBACK_POLICY"],
        "ops": len(results),
        "compared": compared,
        "counts": counts,
        "parity_fraction": passing / compared if compared else 0.0,
        "onnxruntime_fraction": counts["onnxruntime"] / compared if compared else 0.0,
        "results": [asdict(r) for r in results],
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['ops']} ops swept ({report['compared']} compared), torch {report['torch']}, "
        f"{report.get('policy', 'FALLBACK_DISABLE')}",
        "",
    ]
    lines.append("| bucket | ops |")
    lines.append("|---|---|")
    for bucket, count in report["counts"].items():
        lines.append(f"| {bucket} | {count} |")
    lines.append("")
    lines.append(
        f"gradient parity: {report['parity_fraction']:.1%} of compared ops; "
        f"entirely in ONNX Runtime: {report['onnxruntime_fraction']:.1%}"
    )
    failing = [r for r in report["results"] if r["bucket"] not in PASSING]
    if failing:
        lines.append("")
        for r in sorted(failing, key=lambda r: (BUCKETS.index(r["bucket"]), r["op"])):
            lines.append(f"- {r['bucket']}: `{r['op']}`: {r['error']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="*", help="op names (OpInfo name[.variant]); default: all swept")
    parser.add_argument("--ci", action="store_true", help="only the CI subset")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per op")
    parser.add_argument("--samples", type=int, default=1, help="sample inputs tried per op")
    parser.add_argument("--json", help="write the report here (rewritten after every op)")
    parser.add_argument(
        "--policy",
        default="FALLBACK_DISABLE",
        help="ORTMODULE_FALLBACK_POLICY for the sweep: FALLBACK_DISABLE (default: every node in ONNX "
        "Runtime or an error) or FALLBACK_UNSUPPORTED_ONNX_MODEL (nodes ONNX Runtime cannot run go "
        "to PyTorch one by one: bucket partly_torch_executor; a whole-model fallback still fails)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip ops already in --json, keep their results"
    )
    args = parser.parse_args(argv)
    os.environ["ORTMODULE_FALLBACK_POLICY"] = args.policy  # the worker processes inherit it
    all_ops = [op_id(o) for o in swept_ops()]
    # The common ops first, so that a partial run (stopped, then --resume'd) covers them.
    names = list(CI_OPS) if args.ci else (args.ops or [*CI_OPS, *(n for n in all_ops if n not in CI_OPS)])
    unknown = sorted(set(names) - set(all_ops))
    if unknown:
        parser.error(f"not swept ops: {unknown}")
    earlier: list[Result] = []
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            earlier = [Result(**r) for r in json.load(f)["results"]]
        seen = {r.op for r in earlier}
        names = [n for n in names if n not in seen]

    def save(results: list[Result]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary([*earlier, *results]), f, indent=1)

    results = sweep(
        names, timeout=args.timeout, max_samples=args.samples, log=lambda s: print(s, flush=True), done=save
    )
    report = summary([*earlier, *results])
    print(format_table(report))
    save(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
